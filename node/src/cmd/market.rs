//! `cannabis market`: what the running node sees of the market.

use std::path::Path;

use cannabis_testnet::ApiClient;

use crate::cli::MarketCommand;
use crate::output::{self, out};

pub(super) fn run(command: MarketCommand, data_dir: &Path) -> anyhow::Result<()> {
    let client = ApiClient::from_data_dir(data_dir)?;
    let now_ms = super::now_ms();
    let left = |at_ms: u64| format!("{} s", at_ms.saturating_sub(now_ms) / 1000);
    match command {
        MarketCommand::Ads { format } => {
            let ads = client.ads()?;
            if format.json {
                return output::json(&ads);
            }
            out!(
                "{:<62} {:>5} {:>9} {:>4} {:>10}",
                "node",
                "cores",
                "memory",
                "gpus",
                "expires in"
            )?;
            for a in &ads {
                out!(
                    "{:<62} {:>5} {:>6} GiB {:>4} {:>10}",
                    a.node,
                    a.cpu_cores,
                    a.memory_bytes >> 30,
                    a.gpus,
                    left(a.expires_at_ms)
                )?;
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
    }
    Ok(())
}
