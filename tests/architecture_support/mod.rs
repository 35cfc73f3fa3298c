//! Support for `tests/architecture_invariants.rs`: source scanning (`scan`), one scanner per
//! invariant (`rules`), and probe layers that watch the runtime's messages (`probe`).
pub mod probe;
pub mod rules;
pub mod scan;
