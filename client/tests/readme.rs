//! Rust examples outside the crate (the project README, docs/*.md) must be copies of
//! the crate README's (client/README.md), which is the crate's documentation and so
//! compiled as doctests: an example cannot drift from the API. (Those files have
//! indented text blocks that rustdoc would take for Rust, so they are not included
//! directly.)

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
fn rust_examples_outside_the_crate_are_the_crate_doctests() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let crate_readme = std::fs::read_to_string(root.join("README.md")).expect("client/README.md");
    assert!(
        !rust_blocks(&crate_readme).is_empty(),
        "client/README.md has no Rust example"
    );
    let mut files = vec![root.join("../README.md")];
    for entry in std::fs::read_dir(root.join("../docs")).expect("docs/") {
        let path = entry.expect("docs/ entry").path();
        if path.extension().is_some_and(|e| e == "md") {
            files.push(path);
        }
    }
    for file in files {
        let text = std::fs::read_to_string(&file).expect("a Markdown file");
        for block in rust_blocks(&text) {
            assert!(
                crate_readme.contains(&block),
                "this example of {} is not in client/README.md (the doctested copy):\n{block}",
                file.display()
            );
        }
    }
}
