//! Every `cannabis` command the guides show is one the binary takes. Each line of their
//! shell blocks that runs `cannabis` is given to it with `--help` added: that parses the
//! subcommands and flags the line names, and fails on any the binary does not know,
//! without running anything. (What the commands do is exercised by the tests of each
//! feature; this keeps the guides from drifting from the binary.)

use std::path::Path;
use std::process::Command;

/// The documents whose shell blocks are checked.
const GUIDES: &[&str] = &[
    "README.md",
    "docs/operator-guide.md",
    "docs/requester-guide.md",
    "docs/testnet-guide.md",
    "docs/settlement.md",
    "docs/confidential.md",
    "docs/security.md",
    "docs/architecture.md",
    "docs/benchmarks.md",
];

/// The lines of a document's shell blocks, continuations joined.
fn shell_lines(text: &str) -> Vec<String> {
    let mut lines = Vec::new();
    let mut inside = false;
    let mut pending = String::new();
    for line in text.lines() {
        let trimmed = line.trim_start();
        if let Some(info) = trimmed.strip_prefix("```") {
            inside = !inside && matches!(info.trim(), "sh" | "bash" | "shell" | "console");
            continue;
        }
        if !inside {
            continue;
        }
        let line = line.trim().trim_start_matches("$ ");
        match line.strip_suffix('\\') {
            Some(head) => pending.push_str(head),
            None => {
                pending.push_str(line);
                lines.push(std::mem::take(&mut pending));
            }
        }
    }
    lines
}

/// Shell words, with quotes removed and a trailing `# comment` dropped.
fn words(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut word = String::new();
    let mut quote: Option<char> = None;
    let mut started = false;
    for c in line.chars() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), c) => word.push(c),
            (None, '\'' | '"') => {
                quote = Some(c);
                started = true;
            }
            (None, '#') if !started => break,
            (None, c) if c.is_whitespace() => {
                if started {
                    out.push(std::mem::take(&mut word));
                    started = false;
                }
            }
            (None, c) => {
                word.push(c);
                started = true;
            }
        }
    }
    if started {
        out.push(word);
    }
    out
}

/// The `cannabis` commands of a line (each part of `&&`, `||`, `|` or `;` that runs it,
/// after `sudo` and `VAR=value` prefixes), without the program name and with an optional
/// part's brackets (`[--part 62.5]`) dropped.
fn commands(line: &str) -> Vec<Vec<String>> {
    let words = words(line);
    words
        .split(|w| matches!(w.as_str(), "&&" | "||" | "|" | ";"))
        .filter_map(|part| {
            let mut rest = part
                .iter()
                .skip_while(|w| w.as_str() == "sudo" || (w.contains('=') && !w.starts_with('-')));
            (rest.next()?.as_str() == "cannabis").then(|| {
                rest.filter(|w| w.as_str() != "...")
                    .map(|w| w.trim_start_matches('[').trim_end_matches(']').to_string())
                    .filter(|w| !w.is_empty())
                    .collect()
            })
        })
        .collect()
}

#[test]
fn the_shell_words_of_a_guide_line_are_read_as_a_shell_would() {
    assert_eq!(
        commands("cannabis job accept JOB_ID [--part 62.5]   # pay part"),
        vec![vec!["job", "accept", "JOB_ID", "--part", "62.5"]]
    );
    assert_eq!(
        commands("sudo RUST_LOG=debug cannabis node run --config 'a b.toml' && cat x"),
        vec![vec!["node", "run", "--config", "a b.toml"]]
    );
    assert_eq!(
        commands("cargo build && cannabis --version"),
        vec![vec!["--version"]]
    );
    assert!(commands("# cannabis node run").is_empty());
    assert_eq!(
        shell_lines("text\n```sh\ncannabis node run \\\n  --no-mdns\n```\n```toml\nx = 1\n```\n"),
        vec!["cannabis node run --no-mdns"]
    );
}

#[test]
fn every_command_the_guides_show_is_one_the_binary_takes() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut checked = 0;
    let mut wrong = Vec::new();
    for guide in GUIDES {
        let text = std::fs::read_to_string(root.join(guide)).unwrap();
        for line in shell_lines(&text) {
            for args in commands(&line) {
                let o = Command::new(env!("CARGO_BIN_EXE_cannabis"))
                    .args(&args)
                    .arg("--help")
                    .output()
                    .unwrap();
                checked += 1;
                if !o.status.success() {
                    let why = String::from_utf8_lossy(&o.stderr);
                    let why = why.lines().next().unwrap_or("").to_string();
                    wrong.push(format!("{guide}: `{line}`: {why}"));
                }
            }
        }
    }
    assert!(
        checked > 50,
        "only {checked} commands found: is the extraction broken?"
    );
    assert!(
        wrong.is_empty(),
        "commands the binary does not take:\n{}",
        wrong.join("\n")
    );
}
