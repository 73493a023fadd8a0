//! Figures for prefix reuse and persistence on a real model:
//!
//! - time to first token of a request sharing an N-token system prompt, cold (prefilled)
//!   vs prefix hit (cells reused from the prefix index), through the agent store;
//! - restoring an N-token session from its file vs re-prefilling it;
//! - session file bytes per token for f16, q8 and q4 K/V.
//!
//! `cargo run --release -p kvplug --example prefix_reuse -- MODEL [BACKEND] [N]`
//! (defaults: cpu, 2048), after `cargo build --release --workspace`.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result};
use kvplug::model_fingerprint;
use kvplug::session_file::{self, Session};
use kvplug::{
    generate, AgentStore, AgentStoreOptions, CacheKind, GenOptions, KvDtype, PluginSearch, Runtime,
    Text,
};

/// About `n` tokens of varied English text.
fn long_prompt(text: &Text, n: usize) -> Result<Vec<i32>> {
    let mut doc = String::from("You are a careful assistant. Use the following notes.\n");
    let mut i = 0;
    loop {
        doc += &format!(
            "Note {i}: the shipment of {} crates left dock {} at {}:{:02} and reached warehouse {} two days later, \
             where inspector number {} recorded {} damaged items.\n",
            17 + i * 3,
            i % 7,
            6 + i % 12,
            (i * 13) % 60,
            100 + i,
            40 + i % 9,
            i % 5
        );
        let ids = text.encode(&doc)?;
        if ids.len() >= n {
            return Ok(ids[..n].to_vec());
        }
        i += 1;
    }
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let model = args
        .first()
        .context("usage: prefix_reuse MODEL [BACKEND] [N]")?;
    let backend = args.get(1).map_or("cpu", String::as_str);
    let n: usize = args.get(2).map_or(Ok(2048), |s| s.parse())?;
    let runtime = Runtime::load(&PluginSearch::of_build());
    let m = kvplug::Llm::builder(Path::new(model))
        .runtime(&runtime)
        .backend(backend)
        .build_model()?;
    let dir = m.dir().to_path_buf();
    let text = Text::load(&dir)?;
    let system = long_prompt(&text, n)?;
    let question =
        |q: &str| -> Result<Vec<i32>> { Ok([system.as_slice(), &text.encode(q)?].concat()) };
    let files = tempfile_dir()?;

    // Time to first token: cold, then a prefix hit, through the agent store.
    let mut store = AgentStore::new(
        &m,
        AgentStoreOptions {
            capacity: 2 * n + 512,
            kv_dtype: KvDtype::F16,
            dir: files.clone(),
            warm: Default::default(),
        },
    )?;
    let cold = store.generate(
        None,
        &question("Which dock did note 3 mention?")?,
        GenOptions::max_tokens(1),
    )?;
    let hit = store.generate(
        None,
        &question("How many items were damaged in note 5?")?,
        GenOptions::max_tokens(1),
    )?;
    println!("{backend}, {n}-token shared system prompt:");
    println!(
        "  time to first token  cold {:.1} ms ({} prefilled)   prefix hit {:.1} ms ({} cached, {} prefilled)   {:.1}x",
        cold.ttft * 1e3,
        cold.prefilled_tokens,
        hit.ttft * 1e3,
        hit.cached_tokens,
        hit.prefilled_tokens,
        cold.ttft / hit.ttft
    );
    drop(store);

    // Session restore vs re-prefill, and file sizes.
    let t = Instant::now();
    let fingerprint = model_fingerprint(&dir)?;
    let fingerprint_s = t.elapsed().as_secs_f64();
    for dtype in [KvDtype::F16, KvDtype::Q8_DEFAULT, KvDtype::Q4_DEFAULT] {
        let capacity = n + 64;
        let mut s = m.context(CacheKind::Contiguous, capacity, dtype)?;
        let t = Instant::now();
        generate(
            &mut s,
            None,
            0,
            &system,
            0,
            GenOptions::default(),
            &mut |_| Ok(()),
        )?;
        let prefill_s = t.elapsed().as_secs_f64();
        let path = files.join(format!("s-{dtype}.kvsession.safetensors"));
        let t = Instant::now();
        let rows = s.export_seq(0)?;
        let export_s = t.elapsed().as_secs_f64();
        let bytes = session_file::write(
            &path,
            &Session {
                rows,
                tokens: system.clone(),
                model: fingerprint.clone(),
                key_basis: s.key_basis(),
                model_name: String::new(),
                app: Default::default(),
            },
        )?;
        let save_s = t.elapsed().as_secs_f64();
        let r = m.context(CacheKind::Contiguous, capacity, dtype)?;
        let t = Instant::now();
        let loaded = session_file::read(&path)?;
        loaded.check_fits(&path, &fingerprint, dtype, r.key_basis(), capacity)?;
        let read_s = t.elapsed().as_secs_f64();
        r.import_seq(0, &loaded.rows)?;
        let restore_s = t.elapsed().as_secs_f64();
        println!(
            "  {dtype:<4} session: {:.0} bytes/token ({:.1} MB), save {:.1} ms (export {:.1}), restore {:.1} ms (read and check {:.1}) vs re-prefill {:.0} ms ({:.0}x)",
            bytes as f64 / n as f64,
            bytes as f64 / 1e6,
            save_s * 1e3,
            export_s * 1e3,
            restore_s * 1e3,
            read_s * 1e3,
            prefill_s * 1e3,
            prefill_s / restore_s
        );
    }
    println!(
        "  model fingerprint (once per model load): {:.0} ms",
        fingerprint_s * 1e3
    );
    std::fs::remove_dir_all(&files)?;
    Ok(())
}

fn tempfile_dir() -> Result<PathBuf> {
    let d = std::env::temp_dir().join(format!("kvplug-prefix-reuse-{}", std::process::id()));
    std::fs::create_dir_all(&d)?;
    Ok(d)
}
