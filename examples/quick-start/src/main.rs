use kvplug::{GenOptions, Llm, Message};

fn main() -> kvplug::Result<()> {
    let path = std::env::args()
        .nth(1)
        .unwrap_or("models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf".into());
    let llm = Llm::builder(path).backend("cpu").build()?; // plugins: KVPLUG_PLUGIN_PATH, or beside the binary
    let question = Message::user("Write a Python function that reverses a string.");
    let answer = llm.chat_stream(&[question], GenOptions::max_tokens(64), &mut |piece| {
        print!("{piece}");
        Ok(())
    })?;
    println!("\n[{} tokens, {:?}]", answer.ids.len(), answer.finish);
    Ok(())
}
