//! The GGUF container: header, metadata and tensor infos, read by [`GgufFile::read`].
//!
//! kvplug reads the container itself rather than through candle's `gguf_file`, for two
//! reasons. candle refuses a whole file that holds one tensor type it does not know (GPT-OSS
//! ships its experts in MXFP4, ggml type 39), where kvplug wants to read the file and name
//! the tensor it cannot compute. And candle allocates every length the header claims before
//! reading it and divides by `general.alignment` unchecked, so one corrupt number panicked or
//! aborted the process (the fuzz test found a capacity overflow within three inputs). Here
//! every claimed length is checked against the bytes that remain before it is read, counts
//! are capped ([`MAX_ARRAY`], [`MAX_TENSORS`]) and reservations bounded, so memory follows
//! what the file really holds; every tensor's extent is checked against the file. Metadata
//! values are candle's [`Value`] (the block formats are still dequantized by candle's
//! reference code, for `import`).

use std::collections::HashMap;
use std::io::{BufReader, Read};
use std::path::Path;

use candle_core::quantized::gguf_file::Value;

use crate::error::{fail, Context, Result};
use kvplug_core::files::open_regular;

/// Deepest array nesting accepted (real files nest at most one level).
const MAX_DEPTH: usize = 4;
/// Most dimensions of a tensor (ggml's `GGML_MAX_DIMS`).
const MAX_DIMS: u32 = 4;
/// The data section's alignment when `general.alignment` does not say.
const DEFAULT_ALIGNMENT: u64 = 32;
/// Most elements of one metadata array (real vocabularies and merge lists: under 2^20).
pub const MAX_ARRAY: u64 = 1 << 24;
/// Most tensors in one file (real files: under 2^14).
pub const MAX_TENSORS: u64 = 1 << 20;
/// Most elements reserved ahead of reading them (a vector grows past it as items arrive).
const RESERVE: u64 = 1 << 16;

/// One tensor's place: its ggml type, its dims in row-major order (ggml's reversed:
/// `[rows, cols]` for a matrix), and its offset in the data section.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    pub ggml_type: u32,
    pub dims: Vec<usize>,
    pub offset: u64,
}

impl TensorInfo {
    /// Elements.
    pub fn elems(&self) -> usize {
        self.dims.iter().product()
    }

    /// Bytes the tensor takes (checked at read).
    pub fn bytes(&self) -> u64 {
        let (block, size, _) = ggml_type(self.ggml_type).expect("checked at read");
        (self.elems() / block) as u64 * size as u64
    }
}

/// A ggml type's values per block, bytes per block and name, for the types whose layout
/// kvplug knows (those it computes and those it refuses by name).
pub fn ggml_type(id: u32) -> Option<(usize, usize, &'static str)> {
    Some(match id {
        0 => (1, 4, "f32"),
        1 => (1, 2, "f16"),
        2 => (32, 18, "q4_0"),
        3 => (32, 20, "q4_1"),
        6 => (32, 22, "q5_0"),
        7 => (32, 24, "q5_1"),
        8 => (32, 34, "q8_0"),
        9 => (32, 36, "q8_1"),
        10 => (256, 84, "q2_K"),
        11 => (256, 110, "q3_K"),
        12 => (256, 144, "q4_K"),
        13 => (256, 176, "q5_K"),
        14 => (256, 210, "q6_K"),
        15 => (256, 292, "q8_K"),
        16 => (256, 66, "iq2_xxs"),
        17 => (256, 74, "iq2_xs"),
        18 => (256, 98, "iq3_xxs"),
        19 => (256, 50, "iq1_s"),
        20 => (32, 18, "iq4_nl"),
        21 => (256, 110, "iq3_s"),
        22 => (256, 82, "iq2_s"),
        23 => (256, 136, "iq4_xs"),
        24 => (1, 1, "i8"),
        25 => (1, 2, "i16"),
        26 => (1, 4, "i32"),
        27 => (1, 8, "i64"),
        28 => (1, 8, "f64"),
        29 => (256, 56, "iq1_m"),
        30 => (1, 2, "bf16"),
        34 => (256, 54, "tq1_0"),
        35 => (256, 66, "tq2_0"),
        39 => (32, 17, "mxfp4"),
        _ => return None,
    })
}

/// A GGUF file's header.
pub struct GgufFile {
    pub metadata: HashMap<String, Value>,
    pub tensors: HashMap<String, TensorInfo>,
    /// Where the data section starts.
    pub data_offset: u64,
}

/// A reader that knows how many bytes remain.
struct Cursor<R> {
    r: R,
    left: u64,
    read: u64,
}

impl<R: Read> Cursor<R> {
    fn bytes<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut b = [0u8; N];
        self.r.read_exact(&mut b).context("the header ends early")?;
        self.consumed(N as u64)?;
        Ok(b)
    }
    /// Counts `n` bytes read (a file that grew while read is refused, not wrapped around).
    fn consumed(&mut self, n: u64) -> Result<()> {
        self.left = self
            .left
            .checked_sub(n)
            .context("the file changed while its header was read")?;
        self.read += n;
        Ok(())
    }
    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.bytes()?))
    }
    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.bytes()?))
    }
    /// `n` bytes the header claims, refusing more than remain.
    fn take(&mut self, n: u64, what: &str) -> Result<Vec<u8>> {
        if n > self.left {
            fail!(
                Model,
                "{what} claims {n} bytes but only {} remain in the file",
                self.left
            );
        }
        let mut b = vec![0u8; n as usize];
        self.r.read_exact(&mut b).context("the header ends early")?;
        self.consumed(n)?;
        Ok(b)
    }
    fn string(&mut self, what: &str) -> Result<String> {
        let n = self.u64()?;
        String::from_utf8(self.take(n, what)?)
            .map_err(|_| crate::Error::Model(format!("{what} is not UTF-8")))
    }
    /// One metadata value of type `ty`.
    fn value(&mut self, ty: u32, depth: usize) -> Result<Value> {
        Ok(match ty {
            0 => Value::U8(self.bytes::<1>()?[0]),
            1 => Value::I8(self.bytes::<1>()?[0] as i8),
            2 => Value::U16(u16::from_le_bytes(self.bytes()?)),
            3 => Value::I16(i16::from_le_bytes(self.bytes()?)),
            4 => Value::U32(self.u32()?),
            5 => Value::I32(i32::from_le_bytes(self.bytes()?)),
            6 => Value::F32(f32::from_le_bytes(self.bytes()?)),
            7 => Value::Bool(self.bytes::<1>()?[0] != 0),
            8 => Value::String(self.string("a string value")?),
            9 => {
                if depth >= MAX_DEPTH {
                    fail!(Model, "arrays nested deeper than {MAX_DEPTH}");
                }
                let elem = self.u32()?;
                let n = self.u64()?;
                // Every element takes at least one byte: a count beyond the bytes left is
                // a lie, whatever the element type.
                if n > self.left || n > MAX_ARRAY {
                    fail!(
                        Model,
                        "an array claims {n} elements ({} bytes remain; at most {MAX_ARRAY})",
                        self.left
                    );
                }
                let mut items = Vec::with_capacity(n.min(RESERVE) as usize);
                for _ in 0..n {
                    items.push(self.value(elem, depth + 1)?);
                }
                Value::Array(items)
            }
            10 => Value::U64(self.u64()?),
            11 => Value::I64(i64::from_le_bytes(self.bytes()?)),
            12 => Value::F64(f64::from_le_bytes(self.bytes()?)),
            other => fail!(Model, "unknown metadata value type {other}"),
        })
    }
}

impl GgufFile {
    /// Reads the header of the GGUF at `path`: every claimed length checked against the
    /// file before it is read, every tensor of a known layout lying inside the file in whole
    /// blocks (a tensor of an unknown type is refused by its type id).
    pub fn read(path: &Path) -> Result<Self> {
        let (file, len) = open_regular(path)?;
        let mut c = Cursor {
            r: BufReader::new(file),
            left: len,
            read: 0,
        };
        let invalid =
            |e: crate::Error| e.context(format!("{}: not a valid GGUF file", path.display()));
        let (metadata, infos) = (|| {
            if &c.bytes::<4>()? != b"GGUF" {
                fail!(Model, "no GGUF magic");
            }
            match c.u32()? {
                2 | 3 => {}
                v => fail!(Model, "GGUF version {v} is not supported (2 or 3)"),
            }
            let tensors = c.u64()?;
            let kvs = c.u64()?;
            if tensors > MAX_TENSORS {
                fail!(Model, "{tensors} tensors (at most {MAX_TENSORS})");
            }
            // A key/value takes at least 12 bytes, a tensor info at least 24.
            if kvs
                .saturating_mul(12)
                .saturating_add(tensors.saturating_mul(24))
                > c.left
            {
                fail!(
                    Model,
                    "{kvs} metadata entries and {tensors} tensors cannot fit in the file"
                );
            }
            let mut metadata = HashMap::with_capacity(kvs.min(RESERVE) as usize);
            for _ in 0..kvs {
                let key = c.string("a metadata key")?;
                let ty = c.u32()?;
                metadata.insert(key, c.value(ty, 0)?);
            }
            let mut infos = Vec::with_capacity(tensors.min(RESERVE) as usize);
            for _ in 0..tensors {
                let name = c.string("a tensor name")?;
                let n = c.u32()?;
                if n > MAX_DIMS {
                    fail!(
                        Model,
                        "tensor '{name}' has {n} dimensions (at most {MAX_DIMS})"
                    );
                }
                let mut dims = (0..n).map(|_| c.u64()).collect::<Result<Vec<_>>>()?;
                dims.reverse();
                let ggml_type = c.u32()?;
                let offset = c.u64()?;
                infos.push((name, dims, ggml_type, offset));
            }
            Ok((metadata, infos))
        })()
        .map_err(invalid)?;
        // llama.cpp reads the alignment as a u32; any unsigned width is taken, anything else
        // (a misplaced offset would read every tensor wrong) refused.
        let alignment = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(Value::U8(a)) => u64::from(*a),
            Some(Value::U16(a)) => u64::from(*a),
            Some(Value::U32(a)) => u64::from(*a),
            Some(Value::U64(a)) => *a,
            Some(other) => {
                return Err(invalid(crate::Error::Model(format!(
                    "general.alignment is {other:?}, not an unsigned integer"
                ))))
            }
        };
        if !alignment.is_power_of_two() {
            return Err(invalid(crate::Error::Model(format!(
                "general.alignment {alignment} is not a power of two"
            ))));
        }
        let data_offset = c.read.div_ceil(alignment) * alignment;
        let bad = |m: String| crate::Error::Model(format!("{}: {m}", path.display()));
        let mut tensors = HashMap::with_capacity(infos.len());
        for (name, dims, ggml_type, offset) in infos {
            let Some((block, size, type_name)) = self::ggml_type(ggml_type) else {
                return Err(bad(format!(
                    "tensor '{name}' has ggml type {ggml_type}, which kvplug does not know"
                )));
            };
            let elems = dims
                .iter()
                .try_fold(1u64, |a, &d| a.checked_mul(d))
                .ok_or_else(|| bad(format!("tensor '{name}': its element count overflows")))?;
            if elems == 0 {
                return Err(bad(format!("tensor '{name}' has no elements")));
            }
            if elems % block as u64 != 0 {
                return Err(bad(format!(
                    "tensor '{name}': {elems} elements are not whole {type_name} blocks of \
                     {block}"
                )));
            }
            // As llama.cpp: a tensor starts on the alignment (a shifted offset reads every
            // weight of it wrong, and quietly).
            if offset % alignment != 0 {
                return Err(bad(format!(
                    "tensor '{name}' at offset {offset} is not aligned to {alignment} bytes \
                     (general.alignment)"
                )));
            }
            let end = (elems / block as u64)
                .checked_mul(size as u64)
                .and_then(|b| data_offset.checked_add(offset)?.checked_add(b));
            if end.is_none_or(|e| e > len) {
                return Err(bad(format!(
                    "tensor '{name}' ({elems} {type_name} elements at offset {offset}) lies \
                     past the end of the {len}-byte file"
                )));
            }
            let dims = dims.into_iter().map(|d| d as usize).collect();
            let info = TensorInfo {
                ggml_type,
                dims,
                offset,
            };
            if tensors.insert(name.clone(), info).is_some() {
                return Err(bad(format!("tensor '{name}' appears twice")));
            }
        }
        Ok(GgufFile {
            metadata,
            tensors,
            data_offset,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A GGUF header: version 3, `kvs` (key, type, value bytes), `tensors` (name, dims,
    /// type, offset), then `data` after the default alignment.
    fn file(
        kvs: &[(&str, u32, Vec<u8>)],
        tensors: &[(&str, &[u64], u32, u64)],
        data: usize,
    ) -> Vec<u8> {
        let s = |t: &str| {
            [
                (t.len() as u64).to_le_bytes().to_vec(),
                t.as_bytes().to_vec(),
            ]
            .concat()
        };
        let mut b = b"GGUF".to_vec();
        b.extend(3u32.to_le_bytes());
        b.extend((tensors.len() as u64).to_le_bytes());
        b.extend((kvs.len() as u64).to_le_bytes());
        for (k, ty, v) in kvs {
            b.extend(s(k));
            b.extend(ty.to_le_bytes());
            b.extend(v);
        }
        for (name, dims, ty, offset) in tensors {
            b.extend(s(name));
            b.extend((dims.len() as u32).to_le_bytes());
            dims.iter().for_each(|d| b.extend(d.to_le_bytes()));
            b.extend(ty.to_le_bytes());
            b.extend(offset.to_le_bytes());
        }
        b.resize(b.len().div_ceil(32) * 32 + data, 0);
        b
    }

    fn read(bytes: &[u8]) -> Result<GgufFile> {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("m.gguf");
        std::fs::write(&p, bytes).unwrap();
        GgufFile::read(&p)
    }

    #[test]
    fn reads_tensors_of_any_known_type_and_names_unknown_ones() {
        let ok = file(
            &[("general.alignment", 4, 32u32.to_le_bytes().to_vec())],
            &[("e", &[64, 2], 39, 0), ("w", &[4], 0, 96)],
            112,
        );
        let g = read(&ok).unwrap();
        // MXFP4: 2 rows of 64 values, 2 blocks of 17 bytes each; dims row-major.
        assert_eq!(g.tensors["e"].dims, [2, 64]);
        assert_eq!((g.tensors["e"].bytes(), g.tensors["w"].bytes()), (68, 16));
        let e = read(&file(&[], &[("q", &[32], 41, 0)], 64)).err().unwrap();
        assert!(e.to_string().contains("ggml type 41"), "{e}");
    }

    #[test]
    fn refuses_lies_before_allocating_them() {
        let cases: [(Vec<u8>, &str); 7] = [
            // An array of 2^40 u8 values in a small file.
            (
                file(
                    &[(
                        "a",
                        9,
                        [
                            0u32.to_le_bytes().to_vec(),
                            (1u64 << 40).to_le_bytes().to_vec(),
                        ]
                        .concat(),
                    )],
                    &[],
                    0,
                ),
                "an array claims",
            ),
            (
                file(
                    &[("general.alignment", 5, 64i32.to_le_bytes().to_vec())],
                    &[],
                    0,
                ),
                "not an unsigned integer",
            ),
            (
                file(
                    &[("general.alignment", 4, 48u32.to_le_bytes().to_vec())],
                    &[],
                    0,
                ),
                "not a power of two",
            ),
            (
                file(&[], &[("t", &[32], 0, 0), ("t", &[32], 0, 0)], 256),
                "appears twice",
            ),
            (
                file(&[], &[("t", &[33], 2, 0)], 64),
                "not whole q4_0 blocks",
            ),
            (file(&[], &[("t", &[1 << 40], 0, 0)], 64), "past the end"),
            // Inside the file, but 2 bytes off the default alignment of 32.
            (file(&[], &[("t", &[32], 2, 2)], 64), "not aligned to 32"),
        ];
        for (bytes, says) in cases {
            let e = read(&bytes).err().expect(says).to_string();
            let chain = format!("{e} {:?}", e);
            assert!(chain.contains(says), "{says}: {chain}");
        }
        let mut many = file(&[], &[], 0);
        many[8..16].copy_from_slice(&(MAX_TENSORS + 1).to_le_bytes());
        assert!(read(&many).is_err());
    }
}
