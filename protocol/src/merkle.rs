//! Merkle trees as in RFC 6962 / RFC 9162 (Certificate Transparency), over SHA-256.
//!
//! - leaf hash: `SHA-256(0x00 || data)`; interior node: `SHA-256(0x01 || left || right)`.
//!   The distinct prefixes keep a leaf from ever being read as a node.
//! - empty tree: `SHA-256("")`.
//! - `n > 1` leaves: split at `k`, the largest power of two below `n`; left is the first `k`
//!   leaves. Odd levels are not padded by duplicating the last node (that is what made
//!   Bitcoin's tree ambiguous), so two different leaf lists never share a root.
//!
//! The block header's `compute_root` is this root over the ids (SHA-256 of the canonical
//! encoding) of the block's `ComputeResult`s, in transaction order.

use serde::{Deserialize, Serialize};

use crate::Digest;

const LEAF_PREFIX: u8 = 0x00;
const NODE_PREFIX: u8 = 0x01;

/// The hash of one leaf's data.
pub fn leaf_hash(data: &[u8]) -> Digest {
    Digest::of_parts(&[&[LEAF_PREFIX], data])
}

/// The hash of an interior node.
pub fn node_hash(left: &Digest, right: &Digest) -> Digest {
    Digest::of_parts(&[&[NODE_PREFIX], &left.0, &right.0])
}

/// The root of the empty tree: `SHA-256("")`.
pub fn empty_root() -> Digest {
    Digest::of(b"")
}

/// The root over `leaves` (each item is leaf data, hashed with the leaf prefix here).
pub fn root<D: AsRef<[u8]>>(leaves: &[D]) -> Digest {
    let hashes: Vec<Digest> = leaves.iter().map(|d| leaf_hash(d.as_ref())).collect();
    subtree_root(&hashes)
}

fn subtree_root(hashes: &[Digest]) -> Digest {
    match hashes {
        [] => empty_root(),
        [one] => *one,
        _ => {
            let k = split_point(hashes.len());
            node_hash(&subtree_root(&hashes[..k]), &subtree_root(&hashes[k..]))
        }
    }
}

/// Largest power of two strictly below `n` (for `n >= 2`).
fn split_point(n: usize) -> usize {
    debug_assert!(n >= 2);
    1 << (usize::BITS - 1 - (n - 1).leading_zeros())
}

/// A proof that a leaf is at `index` in a tree of `tree_size` leaves.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct InclusionProof {
    /// Position of the leaf, from 0.
    pub index: u64,
    /// Number of leaves in the tree.
    pub tree_size: u64,
    /// Sibling hashes from the leaf up to the root.
    pub path: Vec<Digest>,
}

/// Why an inclusion proof did not verify.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProofError {
    /// The index is not inside the tree.
    #[error("leaf index {index} is outside a tree of {tree_size} leaves")]
    IndexOutOfRange {
        /// Claimed index.
        index: u64,
        /// Claimed size.
        tree_size: u64,
    },
    /// The path is longer or shorter than a tree of this size needs.
    #[error("proof path has the wrong length for this index and tree size")]
    WrongPathLength,
    /// The path leads to a different root.
    #[error("proof leads to root {computed}, not {expected}")]
    RootMismatch {
        /// Root the proof computes.
        computed: Digest,
        /// Root it was checked against.
        expected: Digest,
    },
}

/// The root over leaves already hashed with [`leaf_hash`].
pub fn root_of_hashes(hashes: &[Digest]) -> Digest {
    subtree_root(hashes)
}

/// The inclusion proof for leaf `index` of a tree given by its leaf hashes, or `None` if
/// the index is outside the tree.
pub fn prove_hashes(hashes: &[Digest], index: usize) -> Option<InclusionProof> {
    if index >= hashes.len() {
        return None;
    }
    let mut path = Vec::new();
    audit_path(hashes, index, &mut path);
    Some(InclusionProof {
        index: index as u64,
        tree_size: hashes.len() as u64,
        path,
    })
}

/// The inclusion proof for leaf `index`, or `None` if the index is outside the tree.
pub fn prove<D: AsRef<[u8]>>(leaves: &[D], index: usize) -> Option<InclusionProof> {
    if index >= leaves.len() {
        return None;
    }
    let hashes: Vec<Digest> = leaves.iter().map(|d| leaf_hash(d.as_ref())).collect();
    let mut path = Vec::new();
    audit_path(&hashes, index, &mut path);
    Some(InclusionProof {
        index: index as u64,
        tree_size: hashes.len() as u64,
        path,
    })
}

fn audit_path(hashes: &[Digest], index: usize, path: &mut Vec<Digest>) {
    if hashes.len() <= 1 {
        return;
    }
    let k = split_point(hashes.len());
    if index < k {
        audit_path(&hashes[..k], index, path);
        path.push(subtree_root(&hashes[k..]));
    } else {
        audit_path(&hashes[k..], index - k, path);
        path.push(subtree_root(&hashes[..k]));
    }
}

/// A whole tree over leaf hashes, every level kept: its root and any leaf's proof in
/// `O(log n)`, where [`root_of_hashes`] and [`prove_hashes`] take `O(n)` each. What a
/// server of many chunks of one file holds.
///
/// Built bottom-up, pairing neighbours and carrying a level's lone last node up unchanged:
/// the same tree as the split-at-a-power-of-two definition above (the left part of every
/// split is a perfect subtree aligned on its size).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tree {
    /// Leaf hashes first, the root's level last.
    levels: Vec<Vec<Digest>>,
}

impl Tree {
    /// The tree over leaves already hashed with [`leaf_hash`].
    pub fn from_leaf_hashes(leaves: Vec<Digest>) -> Self {
        let mut levels = vec![leaves];
        while let Some(last) = levels.last().filter(|l| l.len() > 1) {
            let up = last
                .chunks(2)
                .map(|pair| match pair {
                    [l, r] => node_hash(l, r),
                    [one] => *one,
                    _ => unreachable!("chunks(2) gives one or two"),
                })
                .collect();
            levels.push(up);
        }
        Self { levels }
    }

    /// Number of leaves.
    pub fn size(&self) -> usize {
        self.levels[0].len()
    }

    /// The root (of the empty tree: [`empty_root`]).
    pub fn root(&self) -> Digest {
        match self.levels.last().and_then(|l| l.first()) {
            Some(r) => *r,
            None => empty_root(),
        }
    }

    /// The inclusion proof for leaf `index`, or `None` outside the tree.
    pub fn prove(&self, index: usize) -> Option<InclusionProof> {
        if index >= self.size() {
            return None;
        }
        let mut path = Vec::new();
        let mut i = index;
        for level in &self.levels[..self.levels.len() - 1] {
            // A lone last node has no sibling at this level: it is carried up as it is.
            if let Some(sibling) = level.get(i ^ 1) {
                path.push(*sibling);
            }
            i /= 2;
        }
        Some(InclusionProof {
            index: index as u64,
            tree_size: self.size() as u64,
            path,
        })
    }
}

impl InclusionProof {
    /// Checks that leaf data `data` is included under `root` (RFC 9162 §2.1.3.2).
    pub fn verify(&self, data: &[u8], root: &Digest) -> Result<(), ProofError> {
        self.verify_leaf_hash(&leaf_hash(data), root)
    }

    /// Like [`InclusionProof::verify`] for an already-hashed leaf.
    pub fn verify_leaf_hash(&self, leaf: &Digest, root: &Digest) -> Result<(), ProofError> {
        if self.index >= self.tree_size {
            return Err(ProofError::IndexOutOfRange {
                index: self.index,
                tree_size: self.tree_size,
            });
        }
        let mut f = self.index;
        let mut s = self.tree_size - 1;
        let mut r = *leaf;
        for p in &self.path {
            if s == 0 {
                return Err(ProofError::WrongPathLength);
            }
            if f & 1 == 1 || f == s {
                r = node_hash(p, &r);
                while f & 1 == 0 && f != 0 {
                    f >>= 1;
                    s >>= 1;
                }
            } else {
                r = node_hash(&r, p);
            }
            f >>= 1;
            s >>= 1;
        }
        if s != 0 {
            return Err(ProofError::WrongPathLength);
        }
        if r != *root {
            return Err(ProofError::RootMismatch {
                computed: r,
                expected: *root,
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn leaves(n: usize) -> Vec<Vec<u8>> {
        (0..n).map(|i| vec![i as u8; i % 5 + 1]).collect()
    }

    #[test]
    fn empty_and_single() {
        let none: [&[u8]; 0] = [];
        assert_eq!(
            root(&none).to_string(),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
        assert_eq!(root(&[b"a"]), leaf_hash(b"a"));
        assert_ne!(root(&[b"a"]), Digest::of(b"a"));
    }

    #[test]
    fn odd_trees_are_not_padded() {
        // [a, b, c] must differ from [a, b, c, c] (duplication ambiguity).
        let three = root(&[b"a", b"b", b"c"]);
        let four = root(&[b"a", b"b", b"c", b"c"]);
        assert_ne!(three, four);
        let expected = node_hash(
            &node_hash(&leaf_hash(b"a"), &leaf_hash(b"b")),
            &leaf_hash(b"c"),
        );
        assert_eq!(three, expected);
    }

    #[test]
    fn every_leaf_of_small_trees_proves() {
        for n in 1..=33 {
            let ls = leaves(n);
            let r = root(&ls);
            for i in 0..n {
                let p = prove(&ls, i).unwrap();
                assert_eq!(p.verify(&ls[i], &r), Ok(()), "n={n} i={i}");
            }
            assert!(prove(&ls, n).is_none());
        }
    }

    #[test]
    fn the_kept_tree_is_the_same_tree() {
        assert_eq!(Tree::from_leaf_hashes(Vec::new()).root(), empty_root());
        for n in 1..=70 {
            let hashes: Vec<Digest> = leaves(n).iter().map(|l| leaf_hash(l)).collect();
            let tree = Tree::from_leaf_hashes(hashes.clone());
            assert_eq!(tree.root(), root_of_hashes(&hashes), "n = {n}");
            for i in 0..n {
                assert_eq!(tree.prove(i), prove_hashes(&hashes, i), "n = {n}, i = {i}");
            }
            assert_eq!(tree.prove(n), None);
        }
    }

    #[test]
    fn malformed_proofs_fail() {
        let ls = leaves(7);
        let r = root(&ls);
        let p = prove(&ls, 3).unwrap();
        let mut short = p.clone();
        short.path.pop();
        assert_eq!(short.verify(&ls[3], &r), Err(ProofError::WrongPathLength));
        let mut long = p.clone();
        long.path.push(Digest([0; 32]));
        assert_eq!(long.verify(&ls[3], &r), Err(ProofError::WrongPathLength));
        let mut out = p.clone();
        out.index = 7;
        assert!(matches!(
            out.verify(&ls[3], &r),
            Err(ProofError::IndexOutOfRange { .. })
        ));
        let mut moved = p.clone();
        moved.index = 2;
        assert!(moved.verify(&ls[3], &r).is_err());
        assert!(p.verify(&ls[4], &r).is_err());
    }
}
