//! Support for `tests/architecture_invariants.rs`: source scanning (`scan`), one scanner per
//! invariant (`rules`, and `host_reads` for the layers' host-memory rule), and probe layers that
//! watch the runtime's messages (`probe`).
pub mod host_reads;
pub mod probe;
pub mod rules;
pub mod scan;
