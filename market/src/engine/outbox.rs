//! The engine's outputs in order, with the fence: what commits this node waits until the
//! records it depends on are durable.

use std::collections::{BTreeSet, VecDeque};

use super::{BatchId, Output, RecordKey, RecordOp};

#[derive(Debug, Default)]
pub(super) struct Outbox {
    /// Outputs that pass at once: verdicts, refusals, penalties, events.
    free: VecDeque<Output>,
    /// Outputs that wait for the records changed before them to be durable.
    fenced: VecDeque<Output>,
    /// Records changed since the last batch.
    dirty: BTreeSet<RecordKey>,
    /// The batch the driver is writing.
    waiting: Option<BatchId>,
    next_batch: u64,
}

impl Outbox {
    pub(super) fn dirty(&mut self, key: RecordKey) {
        self.dirty.insert(key);
    }

    pub(super) fn fenced(&mut self, o: Output) {
        self.fenced.push_back(o);
    }

    pub(super) fn free(&mut self, o: Output) {
        self.free.push_back(o);
    }

    pub(super) fn pop_free(&mut self) -> Option<Output> {
        self.free.pop_front()
    }

    pub(super) fn pop_fenced(&mut self) -> Option<Output> {
        self.fenced.pop_front()
    }

    pub(super) fn is_waiting(&self) -> bool {
        self.waiting.is_some()
    }

    pub(super) fn has_dirty(&self) -> bool {
        !self.dirty.is_empty()
    }

    pub(super) fn take_dirty(&mut self) -> BTreeSet<RecordKey> {
        std::mem::take(&mut self.dirty)
    }

    /// Starts a batch: nothing fenced goes out until [`Outbox::persisted`] for it.
    pub(super) fn persist(&mut self, ops: Vec<RecordOp>) -> Output {
        self.next_batch += 1;
        let batch = BatchId(self.next_batch);
        self.waiting = Some(batch);
        Output::Persist { batch, ops }
    }

    pub(super) fn persisted(&mut self, batch: BatchId) {
        if self.waiting == Some(batch) {
            self.waiting = None;
        }
    }
}
