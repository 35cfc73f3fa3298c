//! What each collective costs under the planner's link model `t = latency + bytes / bandwidth`:
//! the messages and bytes through the busiest rank's link, and the time they take.
use super::CollectiveOp;
use crate::placement::Link;

/// Messages and bytes through one rank's link during one collective.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Traffic {
    /// Messages, each paying the link's latency once.
    pub messages: u64,
    /// Payload bytes.
    pub bytes: f64,
}

/// The traffic through the busiest rank of a group of `n_ranks` for one `op` on a buffer of
/// `bytes` bytes, which means: the buffer every rank holds (broadcast, reduce, all-reduce), the
/// whole partitioned buffer (scatter, gather, all-gather: the gathered size; reduce-scatter: each
/// rank's input), or each rank's send buffer (all-to-all). With `n = n_ranks` and `B = bytes`:
///
/// | op | algorithm | messages | bytes |
/// |---|---|---|---|
/// | broadcast | root sends to each rank | n-1 | (n-1)·B |
/// | reduce | each rank sends to the root | n-1 (received) | (n-1)·B (received) |
/// | all-reduce | ring: reduce-scatter, then all-gather | 2(n-1) | 2(n-1)/n·B |
/// | scatter, gather | root to/from each rank | n-1 | (n-1)/n·B |
/// | all-gather, reduce-scatter | ring | n-1 | (n-1)/n·B |
/// | all-to-all | pairwise direct | n-1 | (n-1)/n·B |
///
/// The ring figures are per rank and hold exactly when `n` divides the element count; otherwise a
/// rank's chunks are within one element of `1/n` of the buffer.
pub fn traffic(op: CollectiveOp, bytes: u64, n_ranks: usize) -> Traffic {
    if n_ranks <= 1 {
        return Traffic::default();
    }
    let (n, b) = (n_ranks as f64, bytes as f64);
    let steps = n_ranks as u64 - 1;
    match op {
        CollectiveOp::Broadcast | CollectiveOp::Reduce => Traffic { messages: steps, bytes: (n - 1.0) * b },
        CollectiveOp::AllReduce => Traffic { messages: 2 * steps, bytes: 2.0 * (n - 1.0) / n * b },
        CollectiveOp::Scatter
        | CollectiveOp::Gather
        | CollectiveOp::AllGather
        | CollectiveOp::ReduceScatter
        | CollectiveOp::AllToAll => Traffic { messages: steps, bytes: (n - 1.0) / n * b },
    }
}

/// Seconds one `op` on `bytes` (as [`traffic`] defines them) takes over `link` in a group of
/// `n_ranks`: `messages · latency + bytes / bandwidth` on the busiest rank, the ring's steps and a
/// root's sends being sequential. Zero for a group of one.
///
/// ```
/// use conveyor_engine::collective::{CollectiveOp, cost_s};
/// use conveyor_engine::placement::Link;
/// let link = Link { latency_s: 1e-5, bandwidth_bytes_per_s: 1e9 };
/// // 4 ranks all-reduce 4 MB: 6 steps of 1 MB.
/// let t = cost_s(CollectiveOp::AllReduce, 4_000_000, 4, &link);
/// assert!((t - (6.0 * 1e-5 + 6.0e6 / 1e9)).abs() < 1e-12);
/// ```
pub fn cost_s(op: CollectiveOp, bytes: u64, n_ranks: usize, link: &Link) -> f64 {
    let Traffic { messages, bytes } = traffic(op, bytes, n_ranks);
    messages as f64 * link.latency_s + bytes / link.bandwidth_bytes_per_s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_group_of_one_costs_nothing() {
        for op in CollectiveOp::ALL {
            assert_eq!(cost_s(op, 1 << 20, 1, &Link::default()), 0.0);
        }
    }

    #[test]
    fn ring_all_reduce_is_bandwidth_optimal() {
        // Its bytes per rank approach 2·B as n grows, never more: independent of n, unlike a
        // reduce followed by a broadcast ((n-1)·B on the root each).
        for n in 2..=64 {
            let t = traffic(CollectiveOp::AllReduce, 1000, n);
            assert!(t.bytes < 2000.0);
            assert!(t.bytes <= traffic(CollectiveOp::Broadcast, 1000, n).bytes * 2.0);
        }
    }
}
