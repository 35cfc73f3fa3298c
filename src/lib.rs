//! Conveyor facade: re-exports the engine, layers and schedules so users depend on one crate.
pub use conveyor_engine as engine;
pub use conveyor_layers as layers;
pub use conveyor_schedules as schedules;
