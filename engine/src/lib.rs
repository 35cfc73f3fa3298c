//! Conveyor engine.
