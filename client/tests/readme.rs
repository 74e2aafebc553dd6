//! The project README's Rust examples are the crate README's (client/README.md), which
//! is the crate's documentation and so compiled as doctests: an example in the README
//! cannot drift from the API. (The README itself has indented text blocks that rustdoc
//! would take for Rust, so it is not included directly.)

use std::path::Path;

/// The ```rust blocks of `markdown`, fences included.
fn rust_blocks(markdown: &str) -> Vec<String> {
    let mut blocks = Vec::new();
    let mut current: Option<String> = None;
    for line in markdown.lines() {
        match &mut current {
            None if line.starts_with("```rust") => current = Some(format!("{line}\n")),
            None => {}
            Some(block) => {
                block.push_str(line);
                block.push('\n');
                if line == "```" {
                    blocks.extend(current.take());
                }
            }
        }
    }
    blocks
}

#[test]
fn the_readme_rust_examples_are_the_crate_doctests() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let readme = std::fs::read_to_string(root.join("../README.md")).expect("README.md");
    let crate_readme = std::fs::read_to_string(root.join("README.md")).expect("client/README.md");
    let blocks = rust_blocks(&readme);
    assert!(!blocks.is_empty(), "README.md has no Rust example");
    for block in blocks {
        assert!(
            crate_readme.contains(&block),
            "this README.md example is not in client/README.md (the doctested copy):\n{block}"
        );
    }
}
