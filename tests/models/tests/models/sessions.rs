//! Session files end to end with the synthetic `tiny` model: a sequence saved from one
//! backend and cache kind loads into every backend and kind bit for bit and continues with
//! the same greedy tokens; bad files and bad imports are refused with the cache unchanged.

use std::path::Path;

use kvplug::formats::synth::{synth, PRESETS};
use kvplug::model_fingerprint;
use kvplug::session_file::{self, Session, SessionFileError};
use kvplug::{generate, CacheKind, Context, GenOptions, KeyBasis, KvDtype, Runtime};
use kvplug_plugin_api::AbiErrorKind;

use crate::common;
use common::{runtime, BACKENDS};

const PROMPT: [i32; 9] = [3, 141, 59, 26, 53, 58, 97, 93, 23];
const CAPACITY: usize = 64;
/// Every storage family, with groups that divide the tiny model's head_dim of 16.
const DTYPES: [KvDtype; 5] = [
    KvDtype::F32,
    KvDtype::F16,
    KvDtype::Bf16,
    KvDtype::Q8 { group: 16 },
    KvDtype::Q4 { group: 16 },
];

fn tiny() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    synth(&PRESETS[0], dir.path(), 7, "f32").unwrap();
    dir
}

/// A context of `kind` on `backend`.
fn open(rt: &Runtime, backend: &str, kind: CacheKind, model: &Path, dtype: KvDtype) -> Context {
    common::model(rt, backend, model)
        .context(kind, CAPACITY, dtype)
        .unwrap()
}

/// Greedy: `prompt` written to `seq` at positions `start..`, then `n` tokens generated.
fn greedy(ctx: &mut Context, seq: i32, prompt: &[i32], start: usize, n: usize) -> Vec<i32> {
    let opts = GenOptions {
        max_tokens: n,
        ..GenOptions::default()
    };
    generate(ctx, None, seq, prompt, start, opts, &mut |_| Ok(()))
        .unwrap()
        .ids
}

#[test]
fn a_saved_sequence_resumes_on_every_backend_and_kind() {
    let model = tiny();
    let rt = runtime();
    let fingerprint = model_fingerprint(model.path()).unwrap();
    for dtype in DTYPES {
        // Seq 2 of a cpu seq cache: prompt, then the uninterrupted greedy continuation.
        let mut src = open(&rt, "cpu", CacheKind::Seq, model.path(), dtype);
        let first = greedy(&mut src, 2, &PROMPT, 0, 1)[0];
        let saved = Session {
            rows: src.export_seq(2).unwrap(),
            tokens: PROMPT.to_vec(),
            model: fingerprint.clone(),
            key_basis: src.key_basis(),
            model_name: String::new(),
            app: [("note".to_string(), "test".to_string())].into(),
        };
        assert_eq!(saved.rows.positions.len(), PROMPT.len());
        let expected = greedy(&mut src, 2, &[first], PROMPT.len(), 8);

        let bytes = session_file::to_bytes(&saved).unwrap();
        let loaded = session_file::from_bytes(Path::new("mem"), &bytes).unwrap();
        assert_eq!(
            loaded, saved,
            "{dtype}: the file round trip changed the session"
        );
        for backend in BACKENDS {
            for kind in CacheKind::ALL {
                let mut dst = open(&rt, backend, kind, model.path(), dtype);
                let seq = if kind == CacheKind::Seq { 5 } else { 0 };
                if kind == CacheKind::Tree {
                    dst.import_seq(seq, &loaded.rows).unwrap();
                } else {
                    // In two parts: an import appends to what the sequence holds.
                    let (head, tail) =
                        (loaded.rows.slice(0..4), loaded.rows.slice(4..PROMPT.len()));
                    dst.import_seq(seq, &head).unwrap();
                    dst.import_seq(seq, &tail).unwrap();
                }
                let back = dst.export_seq(seq).unwrap();
                assert!(
                    back == saved.rows,
                    "{dtype} {backend} {kind}: rows differ after import"
                );
                let got = greedy(&mut dst, seq, &[first], PROMPT.len(), 8);
                assert_eq!(
                    got, expected,
                    "{dtype} {backend} {kind}: greedy continuation"
                );
            }
        }
    }
}

fn patch_checksum(bytes: &mut [u8]) {
    let key = b"\"kv_cache.checksum\":\"";
    let at = bytes.windows(key.len()).position(|w| w == key).unwrap() + key.len();
    bytes[at..at + 64].fill(b'0');
    let sum = blake3::hash(bytes).to_hex();
    bytes[at..at + 64].copy_from_slice(sum.as_bytes());
}

#[test]
fn bad_files_and_bad_imports_are_refused_and_change_nothing() {
    let model = tiny();
    let rt = runtime();
    let fingerprint = model_fingerprint(model.path()).unwrap();
    let mut s = open(
        &rt,
        "cpu",
        CacheKind::Contiguous,
        model.path(),
        KvDtype::F16,
    );
    greedy(&mut s, 0, &PROMPT, 0, 0);
    let session = Session {
        rows: s.export_seq(0).unwrap(),
        tokens: PROMPT.to_vec(),
        model: fingerprint.clone(),
        key_basis: s.key_basis(),
        model_name: String::new(),
        app: Default::default(),
    };
    let bytes = session_file::to_bytes(&session).unwrap();
    let p = Path::new("s");

    // Written atomically and read back.
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("a.kvsession.safetensors");
    session_file::write(&file, &session).unwrap();
    assert_eq!(session_file::read(&file).unwrap(), session);
    assert!(
        std::fs::read(&file).unwrap() == bytes,
        "the streamed file is to_bytes' bytes"
    );

    let err = |b: Vec<u8>| session_file::from_bytes(p, &b).unwrap_err();
    for at in [0, 9, 100, bytes.len() / 2, bytes.len() - 1] {
        let mut b = bytes.clone();
        b[at] ^= 0x20;
        assert!(
            matches!(
                err(b),
                SessionFileError::Checksum { .. } | SessionFileError::Malformed { .. }
            ),
            "flipped byte {at} accepted"
        );
    }
    assert!(matches!(
        err(bytes[..bytes.len() - 1].to_vec()),
        SessionFileError::Checksum { .. }
    ));
    let mut newer = bytes.clone();
    let key = b"\"kv_cache.schema_version\":\"1\"";
    let at = newer.windows(key.len()).position(|w| w == key).unwrap();
    newer[at + key.len() - 2] = b'3';
    patch_checksum(&mut newer);
    let e = err(newer);
    assert!(matches!(e, SessionFileError::Schema { .. }), "{e}");
    assert!(
        e.to_string()
            .contains("schema version 3; this kvplug reads versions 1 to 2"),
        "{e}"
    );

    let other = "f".repeat(64);
    let e = session
        .check_fits(p, &other, KvDtype::F16, session.key_basis, CAPACITY)
        .unwrap_err();
    assert!(e.to_string().contains("saved with another model"), "{e}");
    let e = session
        .check_fits(p, &fingerprint, KvDtype::F16, session.key_basis, 4)
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        "s: 9 tokens do not fit a cache of capacity 4"
    );

    // Imports the cache refuses leave it as it was.
    for backend in BACKENDS {
        let tiny_cache = common::model(&rt, backend, model.path())
            .context(CacheKind::Seq, 4, KvDtype::F16)
            .unwrap();
        let e = tiny_cache.import_seq(0, &session.rows).unwrap_err();
        assert_eq!(e.kind, AbiErrorKind::Capacity, "{backend}: {e}");
        assert_eq!(tiny_cache.stats().unwrap().live_cells, 0);

        let busy = open(&rt, backend, CacheKind::Seq, model.path(), KvDtype::F16);
        busy.import_seq(1, &session.rows).unwrap();
        let before = busy.export_seq(1).unwrap();
        let e = busy.import_seq(1, &session.rows).unwrap_err();
        assert!(
            e.message.contains("already holds a history"),
            "{backend}: {e}"
        );
        let mut wrong = session.rows.clone();
        wrong.kv_dtype = "q8".into();
        let e = busy.import_seq(2, &wrong).unwrap_err();
        assert_eq!(e.kind, AbiErrorKind::BadConfig, "{backend}: {e}");
        let mut short = session.rows.clone();
        short.k[1].pop();
        let e = busy.import_seq(2, &short).unwrap_err();
        assert_eq!(e.kind, AbiErrorKind::BadShape, "{backend}: {e}");
        assert_eq!(busy.export_seq(1).unwrap(), before);
        assert_eq!(busy.stats().unwrap().live_cells, PROMPT.len() as u64);
    }
}

#[test]
fn quantized_keys_are_saved_rotated_and_load_only_where_keys_are_rotated() {
    let model = tiny();
    let rt = runtime();
    let fingerprint = model_fingerprint(model.path()).unwrap();
    let dtype = KvDtype::Q4 { group: 16 };
    let plain_model = common::model(&rt, "cpu", model.path()).with_key_rotation(false);
    let mut src = open(&rt, "cpu", CacheKind::Contiguous, model.path(), dtype);
    let mut plain = plain_model
        .context(CacheKind::Contiguous, CAPACITY, dtype)
        .unwrap();
    assert_eq!(src.key_basis(), KeyBasis::Hadamard);
    assert_eq!(plain.key_basis(), KeyBasis::Identity);
    greedy(&mut src, 0, &PROMPT, 0, 0);
    greedy(&mut plain, 0, &PROMPT, 0, 0);
    let (rotated, unrotated) = (src.export_seq(0).unwrap(), plain.export_seq(0).unwrap());
    // Layer 0 sees the same inputs in both: the same V rows, K rows in another basis.
    assert!(rotated.v[0] == unrotated.v[0]);
    assert!(rotated.k[0] != unrotated.k[0]);
    let session = Session {
        rows: rotated,
        tokens: PROMPT.to_vec(),
        model: fingerprint.clone(),
        key_basis: src.key_basis(),
        model_name: String::new(),
        app: Default::default(),
    };
    let p = Path::new("s");
    let bytes = session_file::to_bytes(&session).unwrap();
    let loaded = session_file::from_bytes(p, &bytes).unwrap();
    assert_eq!(loaded.key_basis, KeyBasis::Hadamard);
    loaded
        .check_fits(p, &fingerprint, dtype, src.key_basis(), CAPACITY)
        .unwrap();
    let e = loaded
        .check_fits(p, &fingerprint, dtype, plain.key_basis(), CAPACITY)
        .unwrap_err();
    assert!(matches!(e, SessionFileError::OtherKeyBasis { .. }), "{e}");
    assert!(
        e.to_string().contains(
            "keys saved in the hadamard basis; this context keeps its keys in the identity basis"
        ),
        "{e}"
    );

    // Rotated keys make a version 2 file (earlier readers refuse it by version); its dtype
    // is checked first.
    let version = |b: &[u8]| {
        let key = b"\"kv_cache.schema_version\":\"";
        let at = b.windows(key.len()).position(|w| w == key).unwrap() + key.len();
        at
    };
    assert_eq!(bytes[version(&bytes)], b'2');
    let e = loaded
        .check_fits(p, &fingerprint, KvDtype::F16, KeyBasis::Identity, CAPACITY)
        .unwrap_err();
    assert!(matches!(e, SessionFileError::OtherDtype { .. }), "{e}");

    // A version 1 file without the entry (every earlier writer's) holds unrotated keys; a
    // version 2 file must name its basis.
    let mut older = bytes.clone();
    let key = b"\"kv_cache.key_basis\"";
    let at = older.windows(key.len()).position(|w| w == key).unwrap();
    older[at + 10..at + 13].copy_from_slice(b"xxx");
    let mut unnamed = older.clone();
    patch_checksum(&mut unnamed);
    let e = session_file::from_bytes(p, &unnamed).unwrap_err();
    assert!(matches!(e, SessionFileError::Malformed { .. }), "{e}");
    let v = version(&older);
    older[v] = b'1';
    patch_checksum(&mut older);
    let e = session_file::from_bytes(p, &older)
        .unwrap()
        .check_fits(p, &fingerprint, dtype, src.key_basis(), CAPACITY)
        .unwrap_err();
    assert!(
        e.to_string().contains("keys saved in the identity basis"),
        "{e}"
    );
}
