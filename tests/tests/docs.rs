//! The documentation against itself and the code: every relative link of every
//! Markdown file in the repository leads to a file, every anchor to a heading there;
//! the README stays short; the claims a test can check (the durability mode, the limits'
//! values on docs/operations.md, the methods, tests and variables the docs name) are the
//! code's; every `opmon` command the docs print is one the CLI takes.
//! (client/REFERENCE.md's tables are checked by `reference.rs`.)

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use opmon_agent::caps;
use opmon_agent::edge::server::ServeConfig;
use opmon_agent::{config, phase, storage_dir, store};
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
        format!("At most {} calls run at once", caps::CALLS),
        format!(
            "uids other than root and the agent's own {} together",
            count(caps::CONNECTIONS as u64)
        ),
        format!(
            "disconnected once {} pass without the agent's write",
            seconds(serve.write_stall_timeout)
        ),
        format!("`max_held_bytes` ({})", size(serve.held.total() as u64)),
        format!(
            "At most {} listings and subscription updates are made at once",
            caps::LISTINGS
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
            "at most {} subscriptions, {} snapshotters registered over the API and {} finalizes",
            count(caps::SUBSCRIPTIONS as u64),
            caps::SNAPSHOTTERS,
            caps::FINALIZES
        ),
        format!(
            "processes run at most {} at once",
            count(caps::PROCESSES as u64)
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

/// The repository's files whose name ends with one of `extensions`, outside build
/// output and VCS data.
fn source_files(extensions: &[&str]) -> Vec<PathBuf> {
    fn walk(dir: &Path, extensions: &[&str], out: &mut Vec<PathBuf>) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
            if name.starts_with('.') || name == "target" || name == "node_modules" {
                continue;
            }
            if path.is_dir() {
                walk(&path, extensions, out);
            } else if extensions.iter().any(|e| name.ends_with(e)) {
                out.push(path);
            }
        }
    }
    let mut out = Vec::new();
    walk(&repo(), extensions, &mut out);
    out
}

#[test]
fn the_tests_the_docs_name_exist() {
    // `access::a_refused_peer_gets_403…`: a test target under tests/tests and a function.
    let targets = repo().join("tests/tests");
    let mut named = 0;
    let mut missing = Vec::new();
    for file in markdown_files() {
        let text = read(&file);
        for (i, span) in text.split('`').enumerate() {
            let Some((target, test)) = span.split_once("::") else {
                continue;
            };
            let source = targets.join(format!("{target}.rs"));
            let is_test = test
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
            if i % 2 == 0 || !source.exists() || !is_test {
                continue;
            }
            named += 1;
            if !read(&source).contains(&format!("fn {test}(")) {
                missing.push(format!("{}: {span}", file.display()));
            }
        }
    }
    assert!(
        named >= 15,
        "only {named} tests named: the parser lost them"
    );
    assert!(
        missing.is_empty(),
        "the docs name tests that do not exist:\n{}",
        missing.join("\n")
    );
}

#[test]
fn the_variables_the_docs_name_are_read_by_a_program() {
    // Every `OPMON_*` the code reads: the settings' (made from their keys), and those
    // the sources spell out.
    let word = |text: &str, at: usize| -> String {
        text[at..]
            .chars()
            .take_while(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == '_')
            .collect()
    };
    let mut known: BTreeSet<String> = config::setting_variables().into_iter().collect();
    for file in source_files(&[".rs", ".go", ".sh", ".py", "run"]) {
        let text = std::fs::read_to_string(&file).unwrap_or_default();
        known.extend(text.match_indices("OPMON_").map(|(i, _)| word(&text, i)));
    }
    let mut unread = Vec::new();
    for file in markdown_files() {
        let text = read(&file);
        for (i, _) in text.match_indices("OPMON_") {
            let name = word(&text, i);
            // `OPMON_*`, `OPMON_<KEY>`: the family, not a variable.
            if name.len() > "OPMON_".len() && !known.contains(&name) {
                unread.push(format!("{}: {name}", file.display()));
            }
        }
    }
    assert!(
        unread.is_empty(),
        "the docs name variables no program reads:\n{}",
        unread.join("\n")
    );
}

/// The commands of `program` in `text`: lines of its shell code blocks that start with
/// `program ` (or `$ program `), joined across `\` continuations, and prose code spans
/// that are a command rather than a synopsis (no `<…>`, `[…]`, `a|b` or `…` for words).
/// Each with whether it is a line to run: in prose, `opmon backup wait` may name a
/// command without its arguments.
fn commands_of(program: &str, text: &str) -> Vec<(String, bool)> {
    let start = format!("{program} ");
    let mut commands = Vec::new();
    let (mut fenced, mut shell) = (false, false);
    let mut lines = text.lines();
    while let Some(line) = lines.next() {
        if let Some(language) = line.trim_start().strip_prefix("```") {
            fenced = !fenced;
            // A Go or Rust program's `opmon "opmon/client"` is no command.
            shell = ["", "sh", "console"].contains(&language);
            continue;
        }
        if fenced && !shell {
            continue;
        }
        if fenced {
            let line = line.trim_start();
            let line = line.strip_prefix("$ ").unwrap_or(line);
            if line.starts_with(&start) {
                let mut command = line.to_string();
                while command.ends_with('\\') {
                    command.pop();
                    command.push_str(lines.next().unwrap_or(""));
                }
                commands.push((command, true));
            }
            continue;
        }
        for (i, span) in line.split('`').enumerate() {
            let synopsis = span.contains(['<', '[', '|']) || span.split(' ').any(|w| w == "…");
            if i % 2 == 1 && span.starts_with(&start) && !synopsis {
                commands.push((span.to_string(), false));
            }
        }
    }
    commands
}

/// The words of `command` after the program's name, up to the first pipe, list
/// operator or redirection; shell expansions stay literal.
fn arguments(command: &str) -> Option<Vec<String>> {
    let words = shlex::split(command)?;
    let operator = |w: &String| {
        ["|", "||", "&&", ";", "&"].contains(&w.as_str())
            || w.starts_with(['>', '<'])
            || w.starts_with("2>")
    };
    Some(
        words
            .into_iter()
            .skip(1)
            .take_while(|w| !operator(w))
            .collect(),
    )
}

#[test]
fn every_command_the_docs_print_is_one_the_cli_or_the_agent_takes() {
    let opmon = opmon_tests::workspace_binary("opmon");
    let agent = opmon_tests::workspace_binary("opmon-agent");
    let dir = tempfile::tempdir().expect("a directory to run in");
    let mut checked = 0;
    let mut refused = Vec::new();
    for file in markdown_files() {
        let text = read(&file);
        let agent_lines = commands_of("opmon-agent", &text)
            .into_iter()
            .map(|c| (c, true));
        let opmon_lines = commands_of("opmon", &text).into_iter().map(|c| (c, false));
        for ((command, is_line), is_agent) in agent_lines.chain(opmon_lines) {
            let words = arguments(&command)
                .unwrap_or_else(|| panic!("{}: {command}: unbalanced quotes", file.display()));
            let out = if is_agent {
                // Only what it would run with: --print-config starts nothing.
                let mut agent = opmon_tests::agent_command_of(&agent);
                agent.args(&words);
                if !words.iter().any(|w| w == "--print-config" || w == "--help") {
                    agent.arg("--print-config");
                }
                agent.current_dir(dir.path()).output()
            } else {
                std::process::Command::new(&opmon)
                    .args(&words)
                    .env("OPMON_SOCKET", "/nonexistent/opmon.sock")
                    .env_remove("OPMON_AGENT_UID")
                    .env_remove("COMPLETE")
                    .stdin(std::process::Stdio::null())
                    .current_dir(dir.path())
                    .output()
            }
            .expect("running the command");
            checked += 1;
            // clap's own refusals start with `error:`; anything past parsing (here, the
            // missing agent or file) is the command's.
            let stderr = String::from_utf8_lossy(&out.stderr);
            let named = !is_line && stderr.contains("required arguments were not provided");
            if stderr.starts_with("error:") && !named {
                refused.push(format!("{}: {command}\n{stderr}", file.display()));
            }
        }
    }
    assert!(
        checked >= 25,
        "only {checked} commands found: the parser lost them"
    );
    assert!(
        refused.is_empty(),
        "the docs print commands that are refused:\n{}",
        refused.join("\n")
    );
}

#[test]
fn a_command_the_cli_refuses_is_found() {
    let text = "```sh\n$ opmon backup strat b \\\n  --uid u\n```\nRun `opmon backup get NAME` \
                or `opmon backup|restore start NAME`.\n";
    assert_eq!(
        commands_of("opmon", text),
        [
            ("opmon backup strat b   --uid u".to_string(), true),
            ("opmon backup get NAME".to_string(), false)
        ]
    );
    assert_eq!(
        arguments(r#"opmon-agent --state-dir "$demo/state" 2>"$demo/agent.log" &"#),
        Some(vec!["--state-dir".to_string(), "$demo/state".to_string()])
    );
    let out = std::process::Command::new(opmon_tests::workspace_binary("opmon"))
        .args(["backup", "strat", "b", "--uid", "u"])
        .output()
        .expect("running opmon");
    assert!(String::from_utf8_lossy(&out.stderr).starts_with("error:"));
}

#[test]
fn the_retry_table_of_the_client_page_is_the_methods_declarations() {
    use opmon_client::methods::{self, Retry};
    let text = read(&repo().join("docs/client.md"));
    let row = text
        .lines()
        .find(|l| l.starts_with("| `agent.status`"))
        .expect("the retry table's row");
    let cells: Vec<&str> = row.trim_matches('|').split(" | ").collect();
    assert_eq!(cells.len(), 2, "{row}");
    // The full name of a method the table names by verb (`get`) or in full.
    let full = |name: &str| {
        methods::ALL
            .iter()
            .flat_map(|d| d.names().iter().copied())
            .find(|n| *n == name || n.strip_prefix("backup.") == Some(name))
            .unwrap_or_else(|| panic!("docs/client.md names {name}, which no method is"))
    };
    let mut named = BTreeSet::new();
    for (cell, retry) in cells.iter().zip([Retry::Always, Retry::IfNotSent]) {
        // The methods, without the reasons in parentheses.
        let mut depth = 0;
        let cell: String = cell
            .chars()
            .filter(|c| {
                depth += match c {
                    '(' => 1,
                    ')' => -1,
                    _ => 0,
                };
                depth == 0 && *c != ')'
            })
            .collect();
        for (i, span) in cell.split('`').enumerate() {
            let name = span.trim();
            if i % 2 == 1 && !name.is_empty() && !name.contains(' ') {
                let method = full(name);
                assert_eq!(
                    methods::retry_of(method),
                    retry,
                    "{method} in docs/client.md"
                );
                named.insert(method);
            }
        }
    }
    let unnamed: Vec<&str> = methods::ALL
        .iter()
        .flat_map(|d| d.names().iter().copied())
        .filter(|n| !n.starts_with("restore.") && !named.contains(n))
        .collect();
    assert!(
        unnamed.is_empty(),
        "docs/client.md's retry table lacks {unnamed:?}"
    );
}

/// A table's column names: its header split where two or more spaces are.
fn columns(header: &str) -> Vec<String> {
    header
        .trim()
        .split("  ")
        .map(str::trim)
        .filter(|c| !c.is_empty())
        .map(str::to_owned)
        .collect()
}

#[tokio::test]
async fn the_tables_the_docs_print_have_the_clis_columns() {
    let f = opmon_tests::Fixture::new(&[]).await;
    let opmon = |args: &[&str]| {
        let out = std::process::Command::new(opmon_tests::workspace_binary("opmon"))
            .env_remove("OPMON_SOCKET")
            .arg("--socket")
            .arg(&f.agent.socket)
            .args(args)
            .output()
            .expect("running opmon");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let mut checked = 0;
    for path in markdown_files() {
        let text = read(&path);
        let lines: Vec<&str> = text.lines().collect();
        for pair in lines.windows(2) {
            let Some(command) = pair[0].trim().strip_prefix("$ opmon ") else {
                continue;
            };
            let args: Vec<&str> = command.split_whitespace().collect();
            // The owner a doc's command reads, so that the CLI prints its table.
            if let ["backup" | "restore", _, name, ..] = args[..] {
                opmon(&[args[0], "start", name, "--uid", "docs"]);
            }
            let printed = opmon(&args);
            let header = printed.lines().next().unwrap_or_default();
            // The doc may leave columns out, never add or reorder them.
            let mut cli = columns(header).into_iter();
            for column in columns(pair[1]) {
                assert!(
                    cli.any(|c| c == column),
                    "{}: `$ opmon {command}` prints {header:?}, not the column {column:?} \
                     the doc shows in {:?}",
                    path.display(),
                    pair[1]
                );
            }
            checked += 1;
        }
    }
    assert!(checked >= 3, "{checked} tables checked");
}

/// A package of the workspace as `cargo metadata` describes it: what `cargo run` and
/// `cargo build` can select.
struct Package {
    name: String,
    bins: Vec<String>,
    examples: Vec<String>,
    default_run: Option<String>,
}

fn workspace_packages() -> Vec<Package> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = std::process::Command::new(cargo)
        .current_dir(repo())
        .args([
            "metadata",
            "--no-deps",
            "--format-version",
            "1",
            "--offline",
        ])
        .output()
        .expect("running cargo metadata");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let metadata: serde_json::Value = serde_json::from_slice(&out.stdout).expect("metadata");
    let names = |package: &serde_json::Value, kind: &str| -> Vec<String> {
        package["targets"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|t| {
                t["kind"]
                    .as_array()
                    .is_some_and(|k| k.iter().any(|k| k == kind))
            })
            .filter_map(|t| t["name"].as_str().map(str::to_string))
            .collect()
    };
    metadata["packages"]
        .as_array()
        .expect("packages")
        .iter()
        .map(|p| Package {
            name: p["name"].as_str().expect("a name").to_string(),
            bins: names(p, "bin"),
            examples: names(p, "example"),
            default_run: p["default_run"].as_str().map(str::to_string),
        })
        .collect()
}

/// The programs `cargo build ARGS` or `cargo run ARGS` selects, by cargo's rules for a
/// virtual workspace: the packages of `-p` (else every member), and of those the
/// targets `--bin`, `--bins`, `--example`, `--examples` name (else every binary).
fn cargo_selects(packages: &[Package], args: &[String]) -> BTreeSet<String> {
    let mut chosen: Vec<&str> = Vec::new();
    let (mut bins, mut examples) = (Vec::new(), Vec::new());
    let (mut all_bins, mut all_examples) = (false, false);
    let mut words = args.iter().take_while(|w| *w != "--");
    while let Some(word) = words.next() {
        match word.as_str() {
            "-p" | "--package" => chosen.extend(words.next().map(String::as_str)),
            "--bin" => bins.extend(words.next().cloned()),
            "--example" => examples.extend(words.next().cloned()),
            "--bins" => all_bins = true,
            "--examples" => all_examples = true,
            _ => {}
        }
    }
    let targeted = all_bins || all_examples || !bins.is_empty() || !examples.is_empty();
    let mut selected = BTreeSet::new();
    for p in packages {
        if !chosen.is_empty() && !chosen.contains(&p.name.as_str()) {
            continue;
        }
        for bin in &p.bins {
            if !targeted || all_bins || bins.contains(bin) {
                selected.insert(bin.clone());
            }
        }
        for example in &p.examples {
            if all_examples || examples.contains(example) {
                selected.insert(example.clone());
            }
        }
    }
    selected
}

/// The words of a shell `line` in command position: first on the line, after a list
/// operator or keyword, or opening a command substitution or subshell.
fn commands_run(line: &str) -> Vec<&str> {
    let mut commands = Vec::new();
    let mut after_operator = true;
    for word in line.split_whitespace() {
        let opened = word.rfind('(').map(|i| &word[i + 1..]);
        if let Some(command) = opened.filter(|c| !c.is_empty()) {
            commands.push(command);
        } else if after_operator {
            commands.push(word);
        }
        after_operator = [
            "|", "||", "&&", ";", "!", "{", "until", "while", "if", "then", "do",
        ]
        .contains(&word);
    }
    commands
}

/// Every `cargo run` the docs print runs one program, which cargo can tell without a
/// `--bin` (a package with one binary, or its `default-run`); every quick start's `cargo
/// build` line builds each workspace program its block runs, so that on a fresh clone
/// the block does not run what nothing built.
#[test]
fn the_cargo_commands_the_docs_print_build_and_run_what_they_say() {
    let packages = workspace_packages();
    let programs: BTreeSet<String> = packages
        .iter()
        .flat_map(|p| p.bins.iter().chain(&p.examples).cloned())
        .collect();
    let mut checked = 0;
    for path in markdown_files() {
        let text = read(&path);
        // A block is a quick start when it puts the build's output on PATH.
        for block in text.split("```").skip(1).step_by(2) {
            let Some(build) = block.lines().find(|l| l.starts_with("cargo build ")) else {
                continue;
            };
            if !block.contains("$PWD/target/debug") {
                continue;
            }
            let words = shlex::split(build).expect("a build line");
            let built = cargo_selects(&packages, &words[2..]);
            let run: BTreeSet<String> = block
                .lines()
                .flat_map(commands_run)
                .filter(|w| programs.contains(*w))
                .map(str::to_string)
                .collect();
            let missing: Vec<&String> = run.difference(&built).collect();
            assert!(
                missing.is_empty(),
                "{}: `{build}` does not build {missing:?}, which its block runs",
                path.display()
            );
            checked += 1;
        }
        for line in text.lines() {
            let line = line.trim_start();
            let line = line.strip_prefix("$ ").unwrap_or(line);
            if !line.starts_with("cargo run ") {
                continue;
            }
            let words = shlex::split(line).expect("a cargo run line");
            let named = words.iter().any(|w| w == "--bin" || w == "--example");
            let selected = cargo_selects(&packages, &words[2..]);
            let one = if named {
                selected.len() == 1
            } else {
                let chosen: Vec<&Package> = packages
                    .iter()
                    .filter(|p| p.bins.iter().any(|b| selected.contains(b)))
                    .collect();
                chosen.len() == 1 && (chosen[0].bins.len() == 1 || chosen[0].default_run.is_some())
            };
            assert!(
                one,
                "{}: `{line}` does not name one program to run (cargo: \"could not determine \
                 which binary to run\"); it selects {selected:?}",
                path.display()
            );
            checked += 1;
        }
    }
    assert!(checked >= 4, "{checked} cargo commands checked");
}
