//! `cargo run -p muser-text --example tokenize -- MODEL.gguf [--no-special] [--no-bos] TEXT`
//! prints the ids as a JSON array, like `llama-tokenize --ids` (for quick checks without the
//! full CLI).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let model = args
        .first()
        .ok_or("usage: tokenize MODEL.gguf [--no-special] [--no-bos] TEXT")?;
    let parse_special = !args.iter().any(|a| a == "--no-special");
    let add_bos = !args.iter().any(|a| a == "--no-bos");
    let text = args
        .iter()
        .skip(1)
        .rfind(|a| !a.starts_with("--"))
        .cloned()
        .unwrap_or_default();
    let gguf = muser_gguf::GgufFile::open(std::path::Path::new(model))?;
    let tok = muser_text::Tokenizer::from_gguf(&gguf)?;
    let ids = tok.encode(&text, add_bos, parse_special);
    let s: Vec<String> = ids.iter().map(|i| i.to_string()).collect();
    println!("[{}]", s.join(", "));
    Ok(())
}
