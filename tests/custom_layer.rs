//! The custom-layer example as a test: LayerScale passes `gradcheck`, and a model holding it,
//! split over two stages with LayerScale at the boundary, trains bit for bit what one device
//! trains under 1F1B and ZB-H1 (`examples/custom_layer.rs` says how).
#[path = "../examples/custom_layer.rs"]
mod custom_layer_example;

#[test]
fn a_custom_layer_gradchecks_and_trains_across_a_stage_boundary_like_one_device() {
    custom_layer_example::main().unwrap();
}
