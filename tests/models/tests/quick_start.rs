//! The README's and the crate docs' quick start (examples/quick_start.rs), run on the real
//! quantized model: load the plugins, pick "cpu" by string, open the GGUF, generate.

#[path = "../../../host/sdk/examples/quick_start.rs"]
mod quick_start;

#[test]
fn the_quick_start_answers_on_the_real_model() {
    let model = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf");
    assert!(
        model.exists(),
        "run scripts/fetch-models.sh (make test does)"
    );
    let answer =
        quick_start::answer(&model, "Write a Python function that reverses a string.").unwrap();
    assert!(answer.contains("def "), "{answer:?}");
}
