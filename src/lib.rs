//! Conveyor facade: re-exports the engine, layers and schedules so users depend on one crate,
//! and holds the model zoo the CLI and examples share, and the run specification ([`RunSpec`]) the
//! CLI parses into and a library user builds, reads from TOML and prepares.
pub use conveyor_engine as engine;
pub use conveyor_layers as layers;
pub use conveyor_schedules as schedules;

pub mod cli_input;
pub mod data;
pub mod limits;
pub mod pipeline;
pub mod sequential;
pub mod spec;
/// Gradient checks for layers, custom ones included: `conveyor::testing::gradcheck(&mut layer, &shapes)`.
pub use conveyor_engine::testing;
pub mod zoo;

pub use sequential::Sequential;
pub use spec::RunSpec;

/// The README's examples, run as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;

/// The library guide's examples (`docs/library-guide.md`), run as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../docs/library-guide.md")]
pub struct LibraryGuideDoctests;
