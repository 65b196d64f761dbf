//! The node's store: one redb file under the data directory.
//!
//! redb rather than sled: sled 0.34 is beta, flushes with `sync_file_range` (no durability
//! guarantee) and has open reports of databases that will not open after an abrupt stop.
//! redb is ACID and durable when `commit` returns. See `docs/architecture.md`.
//!
//! What is kept: the signed ads and offers of the live market view (so a restart keeps what
//! is still valid; everything is re-verified when loaded), bids received for this node's
//! offers, challenge passes other nodes signed for this one (keyed by verifier), the jobs
//! this node published with their leases and epochs (JSON, keyed by job id), the bids and
//! leases it holds as a worker, the executor's attempt journal, and the node's sequence counters (so a restart never reuses a sequence number).

use std::path::Path;

use anyhow::Context as _;
use redb::{Database, ReadableDatabase as _, ReadableTable as _, TableDefinition};

const ADS: TableDefinition<'_, &[u8], &[u8]> = TableDefinition::new("ads");
const OFFERS: TableDefinition<'_, &[u8], &[u8]> = TableDefinition::new("offers");
const BIDS: TableDefinition<'_, &[u8], &[u8]> = TableDefinition::new("bids");
const COUNTERS: TableDefinition<'_, &str, u64> = TableDefinition::new("counters");
const PASSES: TableDefinition<'_, &[u8], &[u8]> = TableDefinition::new("challenge_passes");
const JOBS: TableDefinition<'_, &[u8], &[u8]> = TableDefinition::new("jobs");
const WORKER_BIDS: TableDefinition<'_, &[u8], &[u8]> = TableDefinition::new("worker_bids");
const WORKER_LEASES: TableDefinition<'_, &[u8], &[u8]> = TableDefinition::new("worker_leases");
const EXEC: TableDefinition<'_, &[u8], &[u8]> = TableDefinition::new("exec_journal");

type Table = TableDefinition<'static, &'static [u8], &'static [u8]>;

/// Records a store keeps as opaque bytes under a byte key.
#[derive(Clone, Copy, Debug)]
pub enum Records {
    /// Verified bids for this node's offers (signed bytes), by message id.
    Bids,
    /// Jobs this node published (JSON), by job id.
    Jobs,
    /// Challenge passes for this node (signed bytes), by verifier.
    Passes,
    /// Bids this node sent as a worker (JSON), by message id.
    WorkerBids,
    /// Leases this node holds as a worker (JSON), by assignment.
    WorkerLeases,
    /// The executor's attempt journal and owner switch (JSON), by record key.
    Exec,
}

impl Records {
    fn table(self) -> Table {
        match self {
            Records::Bids => BIDS,
            Records::Jobs => JOBS,
            Records::Passes => PASSES,
            Records::WorkerBids => WORKER_BIDS,
            Records::WorkerLeases => WORKER_LEASES,
            Records::Exec => EXEC,
        }
    }
}

/// Which gossip table.
#[derive(Clone, Copy, Debug)]
pub enum Kind {
    /// Capability ads, keyed by node address.
    Ad,
    /// Job offers, keyed by job id.
    Offer,
}

impl Kind {
    /// The key a signed message of this kind is kept under (the node's address for ads,
    /// the job id for offers), read from its payload without checking the signature again:
    /// only messages the market view accepted are kept.
    pub fn key_of(self, signed: &[u8]) -> Option<Vec<u8>> {
        use cannabis_protocol::{CapabilityAd, JobOffer, Signed, decode};
        match self {
            Kind::Ad => {
                let s = Signed::<CapabilityAd>::from_bytes(signed).ok()?;
                let ad: CapabilityAd = decode(s.payload()).ok()?;
                Some(ad.node.to_string().into_bytes())
            }
            Kind::Offer => {
                let s = Signed::<JobOffer>::from_bytes(signed).ok()?;
                let offer: JobOffer = decode(s.payload()).ok()?;
                Some(offer.job_id.0.to_vec())
            }
        }
    }

    fn table(self) -> TableDefinition<'static, &'static [u8], &'static [u8]> {
        match self {
            Kind::Ad => ADS,
            Kind::Offer => OFFERS,
        }
    }
}

/// The node's store.
pub struct Store {
    db: Database,
}

impl Store {
    /// Opens (or creates) the store at `path`.
    pub fn open(path: &Path) -> anyhow::Result<Self> {
        let db = Database::create(path)
            .with_context(|| format!("opening the store at {}", path.display()))?;
        let txn = db.begin_write()?;
        txn.open_table(ADS)?;
        txn.open_table(OFFERS)?;
        txn.open_table(COUNTERS)?;
        for r in [
            Records::Bids,
            Records::Jobs,
            Records::Passes,
            Records::WorkerBids,
            Records::WorkerLeases,
            Records::Exec,
        ] {
            txn.open_table(r.table())?;
        }
        txn.commit()?;
        Ok(Self { db })
    }

    /// Keeps a verified gossip message, replacing the previous one under `key`.
    pub fn put(
        &self,
        kind: Kind,
        key: &[u8],
        received_at_us: u64,
        signed: &[u8],
    ) -> anyhow::Result<()> {
        let mut value = Vec::with_capacity(8 + signed.len());
        value.extend_from_slice(&received_at_us.to_le_bytes());
        value.extend_from_slice(signed);
        let txn = self.db.begin_write()?;
        txn.open_table(kind.table())?
            .insert(key, value.as_slice())?;
        txn.commit()?;
        Ok(())
    }

    /// Forgets the message under `key`.
    pub fn remove(&self, kind: Kind, key: &[u8]) -> anyhow::Result<()> {
        let txn = self.db.begin_write()?;
        txn.open_table(kind.table())?.remove(key)?;
        txn.commit()?;
        Ok(())
    }

    /// Every kept message of `kind`, as `(received_at_us, signed bytes)`.
    pub fn load(&self, kind: Kind) -> anyhow::Result<Vec<(u64, Vec<u8>)>> {
        let txn = self.db.begin_read()?;
        let table = txn.open_table(kind.table())?;
        let mut out = Vec::new();
        for row in table.iter()? {
            let (_, v) = row?;
            let v = v.value();
            if v.len() < 8 {
                continue;
            }
            let (time, signed) = v.split_at(8);
            let mut t = [0u8; 8];
            t.copy_from_slice(time);
            out.push((u64::from_le_bytes(t), signed.to_vec()));
        }
        Ok(out)
    }

    /// Keeps a record under `key`, replacing the previous one; durable when this returns.
    pub fn put_record(&self, records: Records, key: &[u8], value: &[u8]) -> anyhow::Result<()> {
        let txn = self.db.begin_write()?;
        txn.open_table(records.table())?.insert(key, value)?;
        txn.commit()?;
        Ok(())
    }

    /// Forgets the record under `key`.
    pub fn remove_record(&self, records: Records, key: &[u8]) -> anyhow::Result<()> {
        let txn = self.db.begin_write()?;
        txn.open_table(records.table())?.remove(key)?;
        txn.commit()?;
        Ok(())
    }

    /// Every record kept, as `(key, value)`.
    pub fn records(&self, records: Records) -> anyhow::Result<Vec<(Vec<u8>, Vec<u8>)>> {
        let txn = self.db.begin_read()?;
        let table = txn.open_table(records.table())?;
        table
            .iter()?
            .map(|row| {
                let (k, v) = row?;
                Ok((k.value().to_vec(), v.value().to_vec()))
            })
            .collect()
    }

    /// The next value of counter `name`: above every value it returned before (durably),
    /// and at least `floor`.
    pub fn next_seq(&self, name: &str, floor: u64) -> anyhow::Result<u64> {
        let txn = self.db.begin_write()?;
        let next = {
            let mut table = txn.open_table(COUNTERS)?;
            let last = table.get(name)?.map(|v| v.value()).unwrap_or(0);
            let next = last.saturating_add(1).max(floor);
            table.insert(name, next)?;
            next
        };
        txn.commit()?;
        Ok(next)
    }
}

/// The executor's journal: every record is committed (durably) before `put` returns.
impl cannabis_runtime::exec::Journal for Store {
    fn put(&self, key: &str, value: &[u8]) -> Result<(), String> {
        self.put_record(Records::Exec, key.as_bytes(), value)
            .map_err(|e| format!("{e:#}"))
    }

    fn all(&self) -> Result<Vec<(String, Vec<u8>)>, String> {
        let rows = self.records(Records::Exec).map_err(|e| format!("{e:#}"))?;
        Ok(rows
            .into_iter()
            .map(|(k, v)| (String::from_utf8_lossy(&k).into_owned(), v))
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn survives_reopening() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("node.redb");
        {
            let s = Store::open(&path).unwrap();
            s.put(Kind::Offer, b"job", 7, b"signed").unwrap();
            s.put(Kind::Ad, b"node", 8, b"ad").unwrap();
            assert_eq!(s.next_seq("ad", 0).unwrap(), 1);
            assert_eq!(s.next_seq("ad", 0).unwrap(), 2);
        }
        let s = Store::open(&path).unwrap();
        assert_eq!(s.load(Kind::Offer).unwrap(), vec![(7, b"signed".to_vec())]);
        assert_eq!(s.next_seq("ad", 0).unwrap(), 3);
        assert_eq!(s.next_seq("ad", 100).unwrap(), 100);
        s.remove(Kind::Offer, b"job").unwrap();
        assert!(s.load(Kind::Offer).unwrap().is_empty());
        assert_eq!(s.load(Kind::Ad).unwrap().len(), 1);
    }
}
