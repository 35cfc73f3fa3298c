//! Conveyor layers.
