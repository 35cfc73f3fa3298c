//! Conveyor facade: re-exports the engine, layers and schedules so users depend on one crate,
//! and holds the model zoo the CLI and examples share.
pub use conveyor_engine as engine;
pub use conveyor_layers as layers;
pub use conveyor_schedules as schedules;

pub mod cli_input;
pub mod data;
pub mod limits;
pub mod pipeline;
pub mod sequential;
/// Gradient checks for layers, custom ones included: `conveyor::testing::gradcheck(&mut layer, &shapes)`.
pub use conveyor_engine::testing;
pub mod zoo;

pub use sequential::Sequential;
