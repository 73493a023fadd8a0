//! The README's quick start (examples/quick-start, a crate using the SDK as an outside crate
//! does: a path dependency and the public API), run on the demo model: it finds the plugins
//! beside its binary, answers the question, and ends on the model's stop token or its limit.

use std::process::Command;

mod common;

#[test]
fn the_quick_start_answers_on_the_demo_model() {
    let model = common::checkout().join("models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf");
    assert!(
        model.exists(),
        "run scripts/fetch-models.sh (make test does)"
    );
    let out = Command::new(common::built_bin("quick-start"))
        .arg(&model)
        .env_remove("KVPLUG_PLUGIN_PATH")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("def "), "{stdout}");
    let last = stdout.trim_end().lines().last().unwrap_or_default();
    assert!(
        last.ends_with("Stop]") || last.ends_with("Length]"),
        "{stdout}"
    );
}
