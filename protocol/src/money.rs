//! Money: integer base units, the founder fee, and the exact split of every job outcome.
//!
//! Rules (also in `docs/protocol.md`):
//! - Amounts are `u64` base units. No floats anywhere near money.
//! - The fee is `floor(paid * rate_bps / 10_000)`: it rounds down, to the base unit; the
//!   worker gets `paid - fee`, so `worker + fee == paid` exactly and any rounding remainder
//!   goes to the worker. The founder fee rate is 100 bps (1%), included in the budget.
//! - A partial acceptance pays `floor(price * accepted_ppm / 1_000_000)`; the remainder of the
//!   lock is refunded.
//! - Rejected, cancelled and expired work pays nothing and earns no fee: all is refunded.
//! - For every outcome `worker_paid + fee_paid + refunded == locked`.
#![deny(clippy::arithmetic_side_effects)]

use serde::{Deserialize, Serialize};

use crate::Address;

/// The founder service fee: 1% = 100 basis points of the accepted paid amount.
pub const FOUNDER_FEE_BPS: u16 = 100;
/// Basis points in a whole.
pub const BPS_DENOMINATOR: u16 = 10_000;
/// Parts per million in a whole (partial acceptance).
pub const PPM_DENOMINATOR: u32 = 1_000_000;

/// An amount of money in integer base units.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
#[serde(transparent)]
pub struct Amount(pub u64);

impl Amount {
    /// Zero.
    pub const ZERO: Amount = Amount(0);
    /// The largest representable amount.
    pub const MAX: Amount = Amount(u64::MAX);

    /// `self + other`, or an overflow error.
    pub fn checked_add(self, other: Amount) -> Result<Amount, MoneyError> {
        self.0
            .checked_add(other.0)
            .map(Amount)
            .ok_or(MoneyError::Overflow)
    }

    /// `self - other`, or an underflow error.
    pub fn checked_sub(self, other: Amount) -> Result<Amount, MoneyError> {
        self.0
            .checked_sub(other.0)
            .map(Amount)
            .ok_or(MoneyError::Underflow)
    }

    /// The sum of `amounts`, or an overflow error.
    pub fn sum<'a>(amounts: impl IntoIterator<Item = &'a Amount>) -> Result<Amount, MoneyError> {
        amounts
            .into_iter()
            .try_fold(Amount::ZERO, |acc, a| acc.checked_add(*a))
    }
}

impl std::fmt::Display for Amount {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::str::FromStr for Amount {
    type Err = MoneyError;
    /// Parses a whole number of base units; `_` may group digits (`1_000_000`).
    fn from_str(s: &str) -> Result<Amount, MoneyError> {
        let digits: String = s.trim().chars().filter(|c| *c != '_').collect();
        if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return Err(MoneyError::Parse(s.to_string()));
        }
        digits
            .parse::<u64>()
            .map(Amount)
            .map_err(|_| MoneyError::Parse(s.to_string()))
    }
}

/// Money errors. None is ever silently absorbed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
pub enum MoneyError {
    /// An addition overflowed `u64`.
    #[error("amount overflow")]
    Overflow,
    /// A subtraction went below zero.
    #[error("amount underflow")]
    Underflow,
    /// Text that is not a whole number of base units.
    #[error(
        "{0:?} is not an amount: amounts are whole numbers of base units (digits, optionally grouped with _)"
    )]
    Parse(String),
    /// A fee rate above 100%.
    #[error("fee rate {0} bps is above 10000 bps (100%)")]
    FeeRate(u16),
    /// A price above what is locked.
    #[error("price {price} is above the locked amount {locked}")]
    PriceAboveLocked {
        /// The agreed price.
        price: Amount,
        /// The locked amount.
        locked: Amount,
    },
    /// An acceptance fraction above one.
    #[error("accepted fraction {0} ppm is above 1000000 ppm")]
    Fraction(u32),
    /// A dispute award above the agreed price.
    #[error("dispute award {award} is above the agreed price {price}")]
    AwardAbovePrice {
        /// Awarded amount.
        award: Amount,
        /// The agreed price.
        price: Amount,
    },
}

/// Fee terms pinned in a job's accepted terms. Later changes apply to new jobs only.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
pub struct FeeTerms {
    /// Fee rate in basis points of the accepted paid amount (100 = 1%).
    pub rate_bps: u16,
    /// Who receives the fee.
    pub recipient: Address,
}

impl FeeTerms {
    /// The founder fee (1%) paid to `recipient`.
    pub fn founder(recipient: Address) -> Self {
        Self {
            rate_bps: FOUNDER_FEE_BPS,
            recipient,
        }
    }

    /// The fee on `paid`: `floor(paid * rate_bps / 10_000)`.
    pub fn fee_on(&self, paid: Amount) -> Result<Amount, MoneyError> {
        fee_on(paid, self.rate_bps)
    }
}

/// `floor(paid * rate_bps / 10_000)`, computed exactly in 128 bits.
pub fn fee_on(paid: Amount, rate_bps: u16) -> Result<Amount, MoneyError> {
    if rate_bps > BPS_DENOMINATOR {
        return Err(MoneyError::FeeRate(rate_bps));
    }
    let fee = u128::from(paid.0)
        .checked_mul(u128::from(rate_bps))
        .ok_or(MoneyError::Overflow)?
        .checked_div(u128::from(BPS_DENOMINATOR))
        .ok_or(MoneyError::Overflow)?;
    // fee <= paid because rate_bps <= 10_000, so it fits in u64.
    u64::try_from(fee)
        .map(Amount)
        .map_err(|_| MoneyError::Overflow)
}

/// What a requester sees before accepting: the budget, the worker's share and the fee.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Quote {
    /// The total budget, fee included.
    pub total: Amount,
    /// What workers receive if the whole budget is paid.
    pub worker_share: Amount,
    /// The service fee on the whole budget.
    pub fee: Amount,
    /// The fee rate in basis points.
    pub fee_rate_bps: u16,
}

impl Quote {
    /// Splits a total budget into worker share and fee.
    pub fn for_budget(total: Amount, rate_bps: u16) -> Result<Quote, MoneyError> {
        let fee = fee_on(total, rate_bps)?;
        Ok(Quote {
            total,
            worker_share: total.checked_sub(fee)?,
            fee,
            fee_rate_bps: rate_bps,
        })
    }
}

/// How a job (or one task of it) ended, for settlement.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(proptest_derive::Arbitrary))]
#[serde(rename_all = "kebab-case")]
pub enum Outcome {
    /// The requester accepted the delivery: the agreed price is paid.
    Accepted,
    /// Undisputed delivery whose review window elapsed: paid as accepted.
    ReviewWindowElapsed,
    /// The requester accepted part of the work: `accepted_ppm` of the price is paid.
    PartiallyAccepted {
        /// Accepted fraction in parts per million.
        accepted_ppm: u32,
    },
    /// The requester rejected the delivery: nothing is paid.
    Rejected,
    /// The job was cancelled before delivery: nothing is paid.
    Cancelled,
    /// The deadline passed without a delivery: nothing is paid.
    Expired,
    /// A dispute was resolved with `award` paid to the worker side (fee included).
    DisputeResolved {
        /// Amount paid out of the agreed price.
        award: Amount,
    },
}

/// Where every base unit of a lock goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Split {
    /// The amount held in escrow.
    pub locked: Amount,
    /// Paid to the worker.
    pub worker_paid: Amount,
    /// Paid to the fee recipient.
    pub fee_paid: Amount,
    /// Returned to the requester.
    pub refunded: Amount,
}

impl Split {
    /// Settles `locked` for an agreed `price` (at most `locked`) and an `outcome`.
    pub fn settle(
        locked: Amount,
        price: Amount,
        outcome: Outcome,
        fee_rate_bps: u16,
    ) -> Result<Split, MoneyError> {
        if price > locked {
            return Err(MoneyError::PriceAboveLocked { price, locked });
        }
        let paid = match outcome {
            Outcome::Accepted | Outcome::ReviewWindowElapsed => price,
            Outcome::PartiallyAccepted { accepted_ppm } => {
                if accepted_ppm > PPM_DENOMINATOR {
                    return Err(MoneyError::Fraction(accepted_ppm));
                }
                let paid = u128::from(price.0)
                    .checked_mul(u128::from(accepted_ppm))
                    .ok_or(MoneyError::Overflow)?
                    .checked_div(u128::from(PPM_DENOMINATOR))
                    .ok_or(MoneyError::Overflow)?;
                Amount(u64::try_from(paid).map_err(|_| MoneyError::Overflow)?)
            }
            Outcome::Rejected | Outcome::Cancelled | Outcome::Expired => Amount::ZERO,
            Outcome::DisputeResolved { award } => {
                if award > price {
                    return Err(MoneyError::AwardAbovePrice { award, price });
                }
                award
            }
        };
        let fee_paid = fee_on(paid, fee_rate_bps)?;
        let split = Split {
            locked,
            worker_paid: paid.checked_sub(fee_paid)?,
            fee_paid,
            refunded: locked.checked_sub(paid)?,
        };
        debug_assert!(split.balances());
        Ok(split)
    }

    /// `worker_paid + fee_paid + refunded == locked`, computed without overflow.
    pub fn balances(&self) -> bool {
        u128::from(self.worker_paid.0)
            .checked_add(u128::from(self.fee_paid.0))
            .and_then(|s| s.checked_add(u128::from(self.refunded.0)))
            == Some(u128::from(self.locked.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn founder_fee_rounds_down() {
        let cases = [
            (0, 0),
            (1, 0),
            (99, 0),
            (100, 1),
            (101, 1),
            (199, 1),
            (200, 2),
            (10_000, 100),
        ];
        for (paid, fee) in cases {
            assert_eq!(
                fee_on(Amount(paid), FOUNDER_FEE_BPS),
                Ok(Amount(fee)),
                "{paid}"
            );
        }
        assert_eq!(
            fee_on(Amount::MAX, FOUNDER_FEE_BPS),
            Ok(Amount(u64::MAX / 100))
        );
    }

    #[test]
    fn quote_shows_share_and_fee() {
        let q = Quote::for_budget(Amount(1_000_000), FOUNDER_FEE_BPS).unwrap();
        assert_eq!(q.worker_share, Amount(990_000));
        assert_eq!(q.fee, Amount(10_000));
        let q = Quote::for_budget(Amount(101), FOUNDER_FEE_BPS).unwrap();
        assert_eq!((q.worker_share, q.fee), (Amount(100), Amount(1)));
    }

    #[test]
    fn settle_every_outcome() {
        let locked = Amount(1_000);
        let price = Amount(800);
        let s = Split::settle(locked, price, Outcome::Accepted, 100).unwrap();
        assert_eq!(
            (s.worker_paid, s.fee_paid, s.refunded),
            (Amount(792), Amount(8), Amount(200))
        );
        let s = Split::settle(
            locked,
            price,
            Outcome::PartiallyAccepted {
                accepted_ppm: 500_000,
            },
            100,
        )
        .unwrap();
        assert_eq!(
            (s.worker_paid, s.fee_paid, s.refunded),
            (Amount(396), Amount(4), Amount(600))
        );
        for o in [Outcome::Rejected, Outcome::Cancelled, Outcome::Expired] {
            let s = Split::settle(locked, price, o, 100).unwrap();
            assert_eq!(
                (s.worker_paid, s.fee_paid, s.refunded),
                (Amount(0), Amount(0), locked)
            );
        }
        let s = Split::settle(
            locked,
            price,
            Outcome::DisputeResolved { award: Amount(150) },
            100,
        )
        .unwrap();
        assert_eq!(
            (s.worker_paid, s.fee_paid, s.refunded),
            (Amount(149), Amount(1), Amount(850))
        );
    }

    #[test]
    fn settle_refuses_bad_terms() {
        assert_eq!(
            Split::settle(Amount(1), Amount(2), Outcome::Accepted, 100),
            Err(MoneyError::PriceAboveLocked {
                price: Amount(2),
                locked: Amount(1)
            })
        );
        assert_eq!(
            Split::settle(
                Amount(10),
                Amount(10),
                Outcome::PartiallyAccepted {
                    accepted_ppm: 1_000_001
                },
                100
            ),
            Err(MoneyError::Fraction(1_000_001))
        );
        assert_eq!(
            Split::settle(Amount(10), Amount(10), Outcome::Accepted, 10_001),
            Err(MoneyError::FeeRate(10_001))
        );
        assert!(matches!(
            Split::settle(
                Amount(10),
                Amount(5),
                Outcome::DisputeResolved { award: Amount(6) },
                100
            ),
            Err(MoneyError::AwardAbovePrice { .. })
        ));
    }

    #[test]
    fn amounts_parse_strictly() {
        assert_eq!("1_000".parse::<Amount>(), Ok(Amount(1000)));
        assert!("12.5".parse::<Amount>().is_err());
        assert!("-1".parse::<Amount>().is_err());
        assert!("".parse::<Amount>().is_err());
        assert!("18446744073709551616".parse::<Amount>().is_err());
        assert_eq!("18446744073709551615".parse::<Amount>(), Ok(Amount::MAX));
    }
}
