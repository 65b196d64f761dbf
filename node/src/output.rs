//! Human output (aligned tables) and JSON. Everything goes through [`line`], which reports
//! a closed stdout as an error instead of panicking, so `cannabis ... | head` ends quietly.

use std::io::Write as _;

use serde::Serialize;

/// Writes one line to stdout.
pub(crate) fn line(args: std::fmt::Arguments<'_>) -> std::io::Result<()> {
    let mut out = std::io::stdout().lock();
    out.write_fmt(args)?;
    out.write_all(b"\n")
}

/// `println!` that returns an error instead of panicking when stdout is closed.
macro_rules! out {
    ($($arg:tt)*) => {
        $crate::output::line(format_args!($($arg)*))
    };
}
pub(crate) use out;

/// Prints `rows` as an aligned two-column table.
pub(crate) fn table(rows: &[(&str, String)]) -> std::io::Result<()> {
    let width = rows.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
    for (k, v) in rows {
        out!("{k:<width$}  {v}")?;
    }
    Ok(())
}

/// Prints `value` as pretty JSON.
pub(crate) fn json<T: Serialize>(value: &T) -> anyhow::Result<()> {
    out!("{}", serde_json::to_string_pretty(value)?)?;
    Ok(())
}

/// Whether `e` is stdout closing under us (`| head`), which is not a failure.
pub(crate) fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

/// A spinner on standard error naming what is awaited; hidden with `--json` or when
/// standard error is not a terminal.
pub(crate) fn spinner(quiet: bool) -> indicatif::ProgressBar {
    use std::io::IsTerminal as _;
    if quiet || !std::io::stderr().is_terminal() {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new_spinner();
    if let Ok(style) = indicatif::ProgressStyle::with_template("{spinner} {elapsed} {msg}") {
        bar.set_style(style);
    }
    bar
}
