//! Progress bars for epochs and steps (indicatif), drawn on stdout only when it is a terminal;
//! every other line `conveyor train` prints goes through [`Progress::println`] so bars and text
//! never tear each other. Lines go through `console` (a closed stdout never panics); indicatif
//! ignores errors drawing the bars.
//!
//! Under MPI there are no bars, on any rank: the launcher hands each rank a pseudo-terminal as
//! stdout whatever its own stdout is (Open MPI does, so `mpirun ... > log` still looks like a
//! terminal to rank 0), and a bar redrawn through it becomes a line per redraw in the log. Rank 0
//! prints the `--log-every` lines instead; the other ranks print nothing (`console::silence`).
use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};

/// The epoch bar and the step bar of one run.
pub struct Progress {
    multi: MultiProgress,
    epochs: ProgressBar,
    steps: ProgressBar,
}

impl Progress {
    /// Bars for `total_steps` steps starting at `first_step`, in `total_epochs` epochs. Hidden when
    /// stdout is not a terminal (indicatif's stdout draw target checks), so captured output
    /// holds only the printed lines, and whenever `bars` is false (an MPI rank).
    pub fn new(first_step: u64, total_steps: u64, steps_per_epoch: u64, bars: bool) -> Progress {
        let target = if bars { ProgressDrawTarget::stdout() } else { ProgressDrawTarget::hidden() };
        let multi = MultiProgress::with_draw_target(target);
        let total_epochs = total_steps.div_ceil(steps_per_epoch.max(1));
        let epochs = multi.add(ProgressBar::new(total_epochs));
        epochs.set_style(
            ProgressStyle::with_template("epoch {pos:>3}/{len:3} [{bar:30.green/dim}] {elapsed_precise}")
                .expect("a valid template")
                .progress_chars("=> "),
        );
        epochs.set_position(first_step / steps_per_epoch.max(1));
        let steps = multi.add(ProgressBar::new(total_steps));
        steps.set_style(
            ProgressStyle::with_template("step  {pos:>5}/{len:5} [{bar:30.cyan/dim}] eta {eta} {msg}")
                .expect("a valid template")
                .progress_chars("=> "),
        );
        steps.set_position(first_step);
        Progress { multi, epochs, steps }
    }

    /// Records a finished step (its loss shown beside the bar) and the epoch it completed, if any.
    pub fn step_done(&self, step: u64, steps_per_epoch: u64, loss: f64) {
        self.steps.set_position(step);
        self.steps.set_message(format!("loss {loss:.4}"));
        self.epochs.set_position(step / steps_per_epoch.max(1));
    }

    /// Prints a line above the bars (or plainly when they are hidden).
    pub fn println(&self, line: impl AsRef<str>) {
        self.multi.suspend(|| crate::cli::console::out(&format!("{}\n", line.as_ref())));
    }

    /// Removes the bars.
    pub fn finish(&self) {
        self.steps.finish_and_clear();
        self.epochs.finish_and_clear();
        let _ = self.multi.clear();
    }
}
