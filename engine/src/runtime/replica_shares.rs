//! How a batch's rows are dealt to data-parallel replicas ([`ReplicaShares`]): evenly, by fixed
//! weights, or by each replica's throughput measured over the first training steps (hybrid
//! replicas: a CPU and a GPU, or fast and slow cores, in one job).
//!
//! Why any shares give one device's result on the whole batch: every micro-batch's loss is
//! divided by the whole batch's rows (`loss.rs`), so a replica's gradient is its rows' share of
//! the batch gradient whatever its number of rows, and the all-reduce adds the shares up. The
//! weighting by share is the normalizer; nothing else is scaled. Only the grouping of the sums
//! changes with the shares, so results agree with one device to rounding (bit for bit when the
//! micro-batches have the same rows as one device's).
use std::fmt;
use std::str::FromStr;

use conveyor_schedules::TimelineEvent;

use super::StepReport;
use crate::{Error, Result};

/// Training steps whose measured throughput sets [`ReplicaShares::Auto`]'s shares; from the next
/// step on they stay fixed, so a run is reproducible after its first steps.
pub const AUTO_SHARE_STEPS: usize = 3;

/// How each batch is shared among the replicas ([`crate::runtime::TrainerBuilder::replica_shares`]).
#[derive(Clone, Debug, Default, PartialEq)]
pub enum ReplicaShares {
    /// Equal shares (differing by at most one row; the first replicas take the extra rows).
    #[default]
    Even,
    /// Rows in proportion to these weights, one per replica (positive, finite), e.g. `3,1`.
    Weights(Vec<f64>),
    /// Even at first; after each of the first [`AUTO_SHARE_STEPS`] training steps, rows in
    /// proportion to each replica's measured throughput (rows over the compute time of its
    /// busiest worker, summed over the steps measured so far); fixed from then on.
    Auto,
}

impl fmt::Display for ReplicaShares {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReplicaShares::Even => f.write_str("even"),
            ReplicaShares::Auto => f.write_str("auto"),
            ReplicaShares::Weights(weights) => {
                let text: Vec<String> = weights.iter().map(f64::to_string).collect();
                f.write_str(&text.join(","))
            }
        }
    }
}

impl FromStr for ReplicaShares {
    type Err = Error;

    /// `even`, `auto`, or comma-separated positive weights (`3,1`, `0.7,0.3`).
    fn from_str(text: &str) -> Result<Self> {
        match text.trim() {
            "even" => Ok(ReplicaShares::Even),
            "auto" => Ok(ReplicaShares::Auto),
            list => {
                let weights = list
                    .split(',')
                    .map(|w| w.trim().parse::<f64>().ok().filter(|w| w.is_finite() && *w > 0.0))
                    .collect::<Option<Vec<f64>>>();
                match weights {
                    Some(weights) => Ok(ReplicaShares::Weights(weights)),
                    None => Err(Error::invalid(
                        "replica shares",
                        format!("`{text}`: use auto, even, or one positive weight per replica such as 3,1"),
                    )),
                }
            }
        }
    }
}

impl ReplicaShares {
    /// Each of `replicas` replicas' rows of a batch of `rows` as the trainer deals them before
    /// anything is measured (`Auto` starts even), refusing a share under `min_rows` (a replica's
    /// micro-batch count): lets a caller check a batch size before training.
    pub fn rows_per_replica(&self, rows: usize, replicas: usize, min_rows: usize) -> Result<Vec<usize>> {
        let policy = match self {
            ReplicaShares::Auto => ReplicaShares::Even,
            other => other.clone(),
        };
        let shares = ShareState::new(policy, replicas).rows(rows, min_rows)?;
        match shares.iter().position(|&s| s < min_rows) {
            Some(short) => Err(Error::invalid(
                "replica shares",
                format!(
                    "replica {short}'s share of {rows} rows is {} rows, fewer than its {min_rows} micro-batches; \
                     use fewer micro-batches or a larger batch",
                    shares[short]
                ),
            )),
            None => Ok(shares),
        }
    }

    /// Refuses weights that do not give one per replica.
    pub(super) fn check(&self, replicas: usize) -> Result<()> {
        match self {
            ReplicaShares::Weights(weights) if weights.len() != replicas => Err(Error::invalid(
                "replica shares",
                format!("{} weights for {replicas} replicas: give one weight per replica", weights.len()),
            )),
            ReplicaShares::Weights(weights) if weights.iter().any(|w| !w.is_finite() || *w <= 0.0) => {
                Err(Error::invalid("replica shares", format!("{weights:?}: every weight must be positive and finite")))
            }
            _ => Ok(()),
        }
    }
}

/// The trainer's current shares: the policy, the weights in use and, for `Auto`, what has been
/// measured.
#[derive(Clone, Debug)]
pub(super) struct ShareState {
    policy: ReplicaShares,
    /// Per replica; `None`: even.
    weights: Option<Vec<f64>>,
    /// `Auto`: rows and busiest-worker compute seconds per replica, summed over measured steps.
    measured: Vec<(f64, f64)>,
    steps_measured: usize,
}

impl ShareState {
    pub(super) fn new(policy: ReplicaShares, replicas: usize) -> ShareState {
        let weights = match &policy {
            ReplicaShares::Weights(weights) => Some(weights.clone()),
            _ => None,
        };
        ShareState { policy, weights, measured: vec![(0.0, 0.0); replicas], steps_measured: 0 }
    }

    /// The policy given to the builder.
    pub(super) fn policy(&self) -> &ReplicaShares {
        &self.policy
    }

    /// Whether the shares are still being measured (`Auto` before [`AUTO_SHARE_STEPS`] steps).
    pub(super) fn measuring(&self) -> bool {
        self.policy == ReplicaShares::Auto && self.steps_measured < AUTO_SHARE_STEPS
    }

    /// Each replica's rows of a batch of `rows`: even, or by the weights (largest remainders,
    /// ties to the lower replica). Under `Auto` a replica gets at least `min_rows` (its
    /// micro-batch count) whatever it measured; with fixed weights a share under that is refused.
    pub(super) fn rows(&self, rows: usize, min_rows: usize) -> Result<Vec<usize>> {
        let replicas = self.measured.len();
        let Some(weights) = &self.weights else {
            return Ok((0..replicas).map(|r| rows / replicas + usize::from(r < rows % replicas)).collect());
        };
        let mut shares = largest_remainders(rows, weights);
        if let Some(short) = shares.iter().position(|&s| s < min_rows) {
            if self.policy != ReplicaShares::Auto {
                return Err(Error::invalid(
                    "replica shares",
                    format!(
                        "replica {short}'s share of {rows} rows is {} rows, fewer than its {min_rows} micro-batches; \
                         give it a larger weight, use fewer micro-batches or a larger batch",
                        shares[short]
                    ),
                ));
            }
            // Auto: lift every short replica to the minimum, taking rows from the largest ones.
            for r in 0..replicas {
                while shares[r] < min_rows {
                    let largest = (0..replicas).max_by_key(|&i| (shares[i], std::cmp::Reverse(i))).unwrap_or(r);
                    if shares[largest] <= min_rows {
                        break;
                    }
                    shares[largest] -= 1;
                    shares[r] += 1;
                }
            }
        }
        Ok(shares)
    }

    /// After a committed training step with `rows_per_replica`: under `Auto`, adds the step's
    /// measurement and re-weights by throughput (a no-op once [`AUTO_SHARE_STEPS`] are measured).
    /// Every rank sees the same report, so every rank computes the same weights.
    pub(super) fn observe(&mut self, report: &StepReport, rows_per_replica: &[usize], n_devices: usize) {
        if !self.measuring() {
            return;
        }
        let busy = busiest_worker_compute_s(report, self.measured.len(), n_devices);
        if busy.iter().any(|&b| b <= 0.0 || !b.is_finite()) {
            return; // nothing measured for some replica: keep the shares
        }
        for ((rows, seconds), (&r, b)) in self.measured.iter_mut().zip(rows_per_replica.iter().zip(busy)) {
            *rows += r as f64;
            *seconds += b;
        }
        self.steps_measured += 1;
        self.weights = Some(self.measured.iter().map(|(rows, seconds)| rows / seconds).collect());
    }

    /// The weights in use, normalised to sum to 1 (even: `1 / replicas` each).
    pub(super) fn fractions(&self) -> Vec<f64> {
        let replicas = self.measured.len();
        match &self.weights {
            None => vec![1.0 / replicas as f64; replicas],
            Some(weights) => {
                let total: f64 = weights.iter().sum();
                weights.iter().map(|w| w / total).collect()
            }
        }
    }
}

/// `rows` dealt in proportion to `weights`: each gets the floor of its exact share, and the rows
/// left go one each to the largest fractional parts (ties to the lower index).
fn largest_remainders(rows: usize, weights: &[f64]) -> Vec<usize> {
    let total: f64 = weights.iter().sum();
    let exact: Vec<f64> = weights.iter().map(|w| rows as f64 * w / total).collect();
    let mut shares: Vec<usize> = exact.iter().map(|e| (e.floor() as usize).min(rows)).collect();
    let mut left = rows.saturating_sub(shares.iter().sum());
    let mut order: Vec<usize> = (0..weights.len()).collect();
    order.sort_by(|&a, &b| (exact[b] - exact[b].floor()).total_cmp(&(exact[a] - exact[a].floor())).then(a.cmp(&b)));
    for &r in order.iter().cycle() {
        if left == 0 {
            break;
        }
        shares[r] += 1;
        left -= 1;
    }
    shares
}

/// Per replica, the compute seconds of its busiest worker (every shard's row counted apart): the
/// replica's time for its share when nothing waits on another replica.
fn busiest_worker_compute_s(report: &StepReport, replicas: usize, n_devices: usize) -> Vec<f64> {
    let mut busy: std::collections::HashMap<(usize, usize), f64> = Default::default();
    let mut add = |row_key: (usize, usize), e: &TimelineEvent| {
        if e.op.is_compute() {
            *busy.entry(row_key).or_default() += e.duration_s();
        }
    };
    for e in &report.timeline.events {
        add((e.device_idx, 0), e);
    }
    for (row, e) in &report.other_events {
        add((e.device_idx, *row), e);
    }
    let mut per_replica = vec![0.0_f64; replicas];
    for ((worker, _), seconds) in busy {
        if let Some(slot) = per_replica.get_mut(worker / n_devices.max(1)) {
            *slot = slot.max(seconds);
        }
    }
    per_replica
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints() {
        assert_eq!("auto".parse::<ReplicaShares>().unwrap(), ReplicaShares::Auto);
        assert_eq!("even".parse::<ReplicaShares>().unwrap(), ReplicaShares::Even);
        let weights = "3, 1".parse::<ReplicaShares>().unwrap();
        assert_eq!(weights, ReplicaShares::Weights(vec![3.0, 1.0]));
        assert_eq!(weights.to_string(), "3,1");
        for bad in ["", "3,0", "3,-1", "a,b", "1,inf", "1,,2"] {
            let error = bad.parse::<ReplicaShares>().unwrap_err().to_string();
            assert!(error.contains("one positive weight per replica"), "{bad}: {error}");
        }
        assert!(ReplicaShares::Weights(vec![1.0]).check(2).unwrap_err().to_string().contains("one weight per replica"));
        assert!(ReplicaShares::Weights(vec![1.0, 2.0]).check(2).is_ok());
    }

    #[test]
    fn rows_follow_the_weights() {
        let even = ShareState::new(ReplicaShares::Even, 3);
        assert_eq!(even.rows(10, 1).unwrap(), vec![4, 3, 3]);
        let fixed = ShareState::new(ReplicaShares::Weights(vec![3.0, 1.0]), 2);
        assert_eq!(fixed.rows(64, 4).unwrap(), vec![48, 16]);
        assert_eq!(fixed.rows(10, 1).unwrap(), vec![8, 2]); // 7.5 / 2.5: the tie goes to replica 0
        let thirds = ShareState::new(ReplicaShares::Weights(vec![1.0, 1.0, 1.0]), 3);
        assert_eq!(thirds.rows(10, 1).unwrap(), vec![4, 3, 3]);
        let short = fixed.rows(8, 4).unwrap_err().to_string();
        assert!(short.contains("replica 1's share of 8 rows is 2 rows, fewer than its 4 micro-batches"), "{short}");
        for rows in 0..50 {
            assert_eq!(largest_remainders(rows, &[0.31, 0.5, 0.19]).iter().sum::<usize>(), rows);
        }
    }

    #[test]
    fn auto_weights_by_measured_throughput_and_keeps_a_minimum() {
        use conveyor_schedules::{OpKind, Timeline};
        let event = |device_idx: usize, seconds: f64| TimelineEvent {
            device_idx,
            stage_idx: Some(0),
            micro_batch_idx: Some(0),
            op: OpKind::Forward,
            start_s: 0.0,
            end_s: seconds,
        };
        let mut timeline = Timeline::new(1, 1);
        timeline.events = vec![event(0, 1.0)];
        let report = StepReport {
            loss: 0.0,
            peak_memory: vec![],
            peak_activation_bytes: vec![],
            timeline,
            other_events: vec![(1, event(1, 3.0))],
            started_s: 0.0,
            step_s: 3.0,
            grad_norm: 0.0,
            op_cpu_times: vec![],
            core_slots: None,
            core_wake_latency_s: None,
            loss_scale: None,
            skipped: false,
            replayed: false,
        };
        let mut auto = ShareState::new(ReplicaShares::Auto, 2);
        assert_eq!(auto.rows(64, 1).unwrap(), vec![32, 32]);
        for step in 0..AUTO_SHARE_STEPS {
            assert!(auto.measuring());
            auto.observe(&report, &[32, 32], 1);
            // Replica 1 takes three times as long for the same rows: a quarter of the batch.
            assert_eq!(auto.rows(64, 1).unwrap(), vec![48, 16], "after step {step}");
        }
        assert!(!auto.measuring());
        let before = auto.fractions();
        auto.observe(&report, &[48, 16], 1);
        assert_eq!(auto.fractions(), before, "fixed after the measured steps");
        assert_eq!(auto.rows(64, 20).unwrap(), vec![44, 20], "at least one row per micro-batch");
    }
}
