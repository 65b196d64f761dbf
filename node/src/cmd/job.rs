//! `cannabis job`: jobs from the requester's side.

use cannabis_protocol::Quote;

use crate::cli::JobCommand;
use crate::output;

pub(super) fn run(command: JobCommand) -> anyhow::Result<()> {
    match command {
        JobCommand::Quote {
            budget,
            fee_bps,
            format,
        } => {
            let q = Quote::for_budget(budget, fee_bps)?;
            if format.json {
                return output::json(&q);
            }
            print_quote(&q)?;
            Ok(())
        }
    }
}

/// The three lines a requester sees before accepting.
pub(super) fn print_quote(q: &Quote) -> std::io::Result<()> {
    let width = q.total.to_string().len();
    output::table(&[
        ("total budget", format!("{:>width$}", q.total)),
        ("worker share", format!("{:>width$}", q.worker_share)),
        (
            "service fee",
            format!("{:>width$}  ({})", q.fee, percent(q.fee_rate_bps)),
        ),
    ])
}

/// `100` bps -> `1.00%`.
pub(super) fn percent(bps: u16) -> String {
    format!("{}.{:02}%", bps / 100, bps % 100)
}
