//! `cannabis market`: what the running node sees of the market.

use std::path::Path;

use cannabis_api::ApiClient;
use cannabis_market::lease::WorkerLeaseState;

use crate::cli::MarketCommand;
use crate::output::{self, out};

pub(super) fn run(command: MarketCommand, data_dir: &Path) -> anyhow::Result<()> {
    let client = ApiClient::from_data_dir(data_dir)?;
    let now_ms = super::now_ms();
    let left = |at_ms: u64| format!("{} s", at_ms.saturating_sub(now_ms) / 1000);
    match command {
        MarketCommand::Ads {
            challenged_within,
            format,
        } => {
            let mut ads = client.ads()?;
            if let Some(within) = challenged_within {
                ads.retain(|a| {
                    a.newest_pass_at_ms
                        .is_some_and(|t| now_ms.saturating_sub(t) <= within)
                });
            }
            if format.json {
                return output::json(&ads);
            }
            out!(
                "{:<62} {:>5} {:>9} {:>4} {:>10} {:>12}",
                "node",
                "cores",
                "memory",
                "gpus",
                "expires in",
                "challenged"
            )?;
            for a in &ads {
                let challenged = a.newest_pass_at_ms.map_or_else(
                    || "never".to_string(),
                    |t| format!("{} s ago", now_ms.saturating_sub(t) / 1000),
                );
                out!(
                    "{:<62} {:>5} {:>6} GiB {:>4} {:>10} {:>12}",
                    a.node,
                    a.cpu_cores,
                    a.memory_bytes >> 30,
                    a.gpus,
                    left(a.expires_at_ms),
                    challenged
                )?;
                if let Some(evidence) = &a.attestation {
                    let verdict = match &a.attestation_verdict {
                        Some(Ok(())) => "verifies here: confidential jobs may come".to_string(),
                        Some(Err(why)) => format!("does not count here: {why}"),
                        None => String::new(),
                    };
                    out!("  attestation {evidence}; {verdict}")?;
                }
            }
            out!("{} ads", ads.len())?;
        }
        MarketCommand::Offers { format } => {
            let offers = client.offers()?;
            if format.json {
                return output::json(&offers);
            }
            out!(
                "{:<36} {:>12} {:>5} {:>5} {:>10}  requester",
                "job",
                "budget",
                "tasks",
                "group",
                "bids for"
            )?;
            for o in &offers {
                out!(
                    "{:<36} {:>12} {:>5} {:>5} {:>10}  {}",
                    o.job_id,
                    o.budget,
                    o.tasks,
                    o.max_group_size,
                    left(o.expires_at_ms),
                    o.requester
                )?;
            }
            out!("{} open offers", offers.len())?;
        }
        MarketCommand::Bids { format } => {
            let bids = client.bids()?;
            if format.json {
                return output::json(&bids);
            }
            out!("{:<36} {:>4} {:>12}  worker", "job", "task", "price")?;
            for b in &bids {
                out!(
                    "{:<36} {:>4} {:>12}  {}",
                    b.job_id,
                    b.task,
                    b.price,
                    b.worker
                )?;
            }
            out!("{} bids", bids.len())?;
        }
        MarketCommand::Leases { format } => {
            let leases = client.leases()?;
            if format.json {
                return output::json(&leases);
            }
            out!(
                "{:<36} {:>4} {:>4} {:>5} {:>10} {:>10}  state",
                "job",
                "task",
                "rank",
                "epoch",
                "price",
                "ends in"
            )?;
            for l in &leases {
                let state = match &l.lease.state {
                    WorkerLeaseState::Current => "current".to_string(),
                    WorkerLeaseState::Ended(why) => why.to_string(),
                };
                out!(
                    "{:<36} {:>4} {:>4} {:>5} {:>10} {:>10}  {}",
                    l.job_id,
                    l.task,
                    l.rank,
                    l.lease.epoch,
                    l.lease.price,
                    left(l.lease.expires_at.0),
                    state
                )?;
            }
            out!("{} leases", leases.len())?;
        }
    }
    Ok(())
}
