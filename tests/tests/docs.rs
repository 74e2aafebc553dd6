//! The documentation against itself and the code: every relative link of every
//! Markdown file in the repository leads to a file, every anchor to a heading there;
//! the README stays short; the claims a test can check (the durability mode, the limits'
//! values on docs/operations.md, the methods the README names) are the code's.
//! (client/REFERENCE.md's tables are checked by `reference.rs`.)

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use opmon_agent::{config, filework, phase, storage_dir, store};
use opmon_client::server::{self, ServeConfig};
use opmon_client::{openrpc, OwnerKind};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .canonicalize()
        .expect("the repository")
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Every `.md` file of the repository, outside build output and VCS data.
fn markdown_files() -> Vec<PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        let entries = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        for entry in entries {
            let path = entry.expect("a directory entry").path();
            let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
            if name.starts_with('.') || name == "target" || name == "node_modules" {
                continue;
            }
            if path.is_dir() {
                walk(&path, out);
            } else if name.ends_with(".md") {
                out.push(path);
            }
        }
    }
    let mut out = Vec::new();
    walk(&repo(), &mut out);
    out.sort();
    out
}

/// The lines of `text` outside fenced code blocks.
fn unfenced(text: &str) -> impl Iterator<Item = &str> {
    let mut fenced = false;
    text.lines().filter(move |line| {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            return false;
        }
        !fenced
    })
}

/// The prose lines of `text` (indented code blocks left out too), with inline code
/// spans removed.
fn prose_lines(text: &str) -> Vec<String> {
    unfenced(text)
        .filter(|line| !line.starts_with("    ") || line.trim_start().starts_with(['-', '|']))
        .map(|line| {
            line.split('`')
                .enumerate()
                .filter(|(i, _)| i % 2 == 0)
                .map(|(_, part)| part)
                .collect()
        })
        .collect()
}

/// GitHub's anchor for a heading: lowercased, spaces as `-`, punctuation dropped.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

/// The anchors of a Markdown file's headings (repeated ones numbered as GitHub does).
fn anchors(text: &str) -> BTreeSet<String> {
    let mut seen = BTreeSet::new();
    for line in unfenced(text) {
        let Some(heading) = line.strip_prefix('#') else {
            continue;
        };
        let heading = heading.trim_start_matches('#');
        if !heading.starts_with(' ') {
            continue;
        }
        let base = slug(&heading.replace('`', ""));
        let mut anchor = base.clone();
        let mut n = 0;
        while seen.contains(&anchor) {
            n += 1;
            anchor = format!("{base}-{n}");
        }
        seen.insert(anchor);
    }
    seen
}

/// The targets of the `[text](target)` links in `text`'s prose.
fn links(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    for line in prose_lines(text) {
        let mut rest = line.as_str();
        while let Some(i) = rest.find("](") {
            let after = &rest[i + 2..];
            let Some(end) = after.find(')') else { break };
            out.push(after[..end].to_string());
            rest = &after[end..];
        }
    }
    out
}

#[test]
fn every_relative_link_and_anchor_in_the_docs_resolves() {
    let files = markdown_files();
    for needed in ["README.md", "client/REFERENCE.md", "docs/architecture.md"] {
        assert!(
            files.contains(&repo().join(needed)),
            "{needed} is missing from {files:?}"
        );
    }
    let mut broken = Vec::new();
    let mut checked = 0;
    for file in &files {
        let text = read(file);
        for target in links(&text) {
            // Web addresses, and rustdoc's intra-doc links of a README the crate includes.
            if target.contains("://") || target.starts_with("mailto:") || target.contains("::") {
                continue;
            }
            checked += 1;
            let (path, anchor) = match target.split_once('#') {
                Some((path, anchor)) => (path, Some(anchor)),
                None => (target.as_str(), None),
            };
            let resolved = if path.is_empty() {
                file.clone()
            } else {
                file.parent().expect("a directory").join(path)
            };
            let shown = file
                .strip_prefix(repo())
                .unwrap_or(file)
                .display()
                .to_string();
            if !resolved.exists() {
                broken.push(format!("{shown}: ({target}): no such file"));
                continue;
            }
            if let Some(anchor) = anchor {
                if !anchors(&read(&resolved)).contains(anchor) {
                    broken.push(format!("{shown}: ({target}): no such heading"));
                }
            }
        }
    }
    assert!(
        checked > 50,
        "only {checked} links found: the parser lost them"
    );
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

#[test]
fn the_anchor_of_a_heading_is_githubs() {
    let text = "# A `code` heading, with punctuation!\n## Twice\n## Twice\n```\n# not one\n```\n";
    assert_eq!(
        anchors(text),
        BTreeSet::from([
            "a-code-heading-with-punctuation".to_string(),
            "twice".to_string(),
            "twice-1".to_string(),
        ])
    );
}

#[test]
fn the_readme_is_short_and_holds_no_benchmark_runs() {
    let readme = read(&repo().join("README.md"));
    let lines = readme.lines().count();
    assert!(
        lines <= 300,
        "README.md has {lines} lines; details go to docs/"
    );
    for dated in ["UTC on 20", "Full mode", "Quick mode"] {
        assert!(
            !readme.contains(dated),
            "README.md holds a benchmark run ({dated:?}): docs/benchmarks.md has the table"
        );
    }
}

#[test]
fn the_docs_name_the_durability_mode_the_store_uses() {
    let mut mentions = 0;
    for file in markdown_files() {
        let text = read(&file);
        for (i, _) in text.match_indices("synchronous=") {
            let mode: String = text[i + "synchronous=".len()..]
                .chars()
                .take_while(char::is_ascii_alphabetic)
                .collect();
            mentions += 1;
            assert_eq!(
                mode,
                store::WRITER_SYNCHRONOUS,
                "{} says synchronous={mode}; the writer commits with synchronous={}",
                file.display(),
                store::WRITER_SYNCHRONOUS
            );
        }
    }
    assert!(mentions > 0, "no page says how commits are made durable");
    let reference = read(&repo().join("client/REFERENCE.md"));
    assert!(
        reference.contains("fsyncs the\n  WAL before it sends the answers"),
        "REFERENCE.md no longer says the WAL is fsynced before the answers"
    );
}

/// `bytes` as the docs write a size: `16 MiB`, `64 KiB`.
fn size(bytes: u64) -> String {
    if bytes.is_multiple_of(1024 * 1024) {
        format!("{} MiB", bytes / (1024 * 1024))
    } else {
        format!("{} KiB", bytes / 1024)
    }
}

/// `n` with a thousands separator, as the docs write counts.
fn count(n: u64) -> String {
    if n >= 1000 {
        format!("{},{:03}", n / 1000, n % 1000)
    } else {
        n.to_string()
    }
}

fn seconds(d: Option<std::time::Duration>) -> String {
    format!("{} s", d.map_or(0, |d| d.as_secs()))
}

#[test]
fn the_limits_on_the_operations_page_are_the_codes() {
    let text = read(&repo().join("docs/operations.md")).replace('\n', " ");
    let text = text.split_whitespace().collect::<Vec<_>>().join(" ");
    let serve = ServeConfig::default();
    let claims = [
        format!(
            "`max_request_size`, {} by default",
            size(u64::from(serve.max_request_body_size))
        ),
        format!(
            "a body must be whole within {}",
            seconds(serve.request_body_timeout)
        ),
        format!(
            "`max_connections_per_uid` ({})",
            config::DEFAULT_MAX_CONNECTIONS_PER_UID
        ),
        format!("At most {} calls run at once", serve.calls_in_flight),
        format!("{} for one uid", serve.calls_per_peer),
        format!(
            "disconnected after {} of reading nothing",
            seconds(serve.write_stall_timeout)
        ),
        format!(
            "holds {} of answers it has not read",
            size(serve.unread_bytes_per_peer)
        ),
        format!(
            "whose answer would pass {}",
            size(u64::from(serve.max_batch_response_bytes))
        ),
        format!(
            "`description` to {} bytes, `err` to {} bytes, `operationUnits` to {} bytes",
            count(phase::MAX_DESCRIPTION as u64),
            count(phase::MAX_ERROR as u64),
            count(phase::MAX_UNITS as u64)
        ),
        format!(
            "a backup name at most {} characters, a restore name at most {}",
            storage_dir::max_owner_name_len(OwnerKind::Backup),
            storage_dir::max_owner_name_len(OwnerKind::Restore)
        ),
        format!(
            "keeps its latest {} events",
            count(store::events::MAX_PER_OWNER as u64)
        ),
        format!(
            "at most {} finalizes run or wait at once",
            filework::MAX_ADMITTED
        ),
    ];
    let wrong: Vec<&String> = claims
        .iter()
        .filter(|c| !text.contains(c.as_str()))
        .collect();
    assert!(
        wrong.is_empty(),
        "docs/operations.md does not say, as the code has it: {wrong:#?}"
    );
    // The page points at the table that holds every limit.
    assert!(text.contains("(../client/REFERENCE.md#limits)"));
}

#[test]
fn the_methods_the_docs_name_exist() {
    // Every `backup.x`, `restore.x` and `snapshotter.x` the document knows: its methods
    // and the notifications it declares.
    let prefixes = ["backup.", "restore.", "snapshotter."];
    let is_name = |word: &str| {
        prefixes.iter().any(|p| word.starts_with(p))
            && word.matches('.').count() == 1
            && !word.ends_with('.')
            && word.chars().all(|c| c.is_ascii_alphanumeric() || c == '.')
    };
    let known: BTreeSet<&str> = openrpc::AGENT_DOCUMENT
        .split('"')
        .filter(|w| is_name(w))
        .collect();
    assert!(known.contains("backup.finalize") && known.contains("snapshotter.register"));
    let mut unknown = Vec::new();
    for file in markdown_files() {
        let text = read(&file);
        // Method names are written as code: `backup.start`, `backup.finalize {…}`.
        for (i, span) in text.split('`').enumerate() {
            let word = span.split([' ', '(']).next().unwrap_or("");
            if i % 2 == 1 && is_name(word) && !known.contains(word) {
                unknown.push(format!("{}: {word}", file.display()));
            }
        }
    }
    assert!(
        unknown.is_empty(),
        "the docs name methods the agent does not have:\n{}",
        unknown.join("\n")
    );
}
