// The model the doc examples of `state_io.rs` train, saved and restored: not a module of the
// crate, each example `include!`s it (hidden) before its `main`. The engine has no layers of its
// own (they live in conveyor-layers, which the engine cannot name), so a two-layer model of
// per-feature scalings `a -> b` over 4 features and a squared loss stand in for a real model.
// Items only, each path written out, so an example's own `use` lines never clash with these.

/// `y = x * w`, elementwise over the features (`w`: `[width]`, PyTorch name `weight`).
#[derive(Debug)]
struct Scale {
    params: Vec<conveyor_engine::Parameter>,
}

impl Scale {
    fn new(weights: Vec<f32>) -> Scale {
        let n = weights.len();
        let value = conveyor_engine::Tensor::from_vec(weights, [n], &conveyor_engine::Device::host()).unwrap();
        Scale { params: vec![conveyor_engine::Parameter { name: "weight".to_string(), value }] }
    }

    fn weight(&self) -> &[f32] {
        self.params[0].value.as_f32().unwrap()
    }
}

impl conveyor_engine::Layer for Scale {
    fn kind(&self) -> &'static str {
        "Scale"
    }
    fn output_shape(&self, s: &[conveyor_engine::Shape]) -> conveyor_engine::Result<conveyor_engine::Shape> {
        Ok(s[0].clone())
    }
    fn parameters(&self) -> &[conveyor_engine::Parameter] {
        &self.params
    }
    fn parameters_mut(&mut self) -> &mut [conveyor_engine::Parameter] {
        &mut self.params
    }
    fn forward(
        &self,
        x: &[&conveyor_engine::Tensor],
        _: &conveyor_engine::ForwardCtx,
    ) -> conveyor_engine::Result<(conveyor_engine::Tensor, conveyor_engine::Saved)> {
        let w = self.weight();
        let y: Vec<f32> = x[0].as_f32()?.iter().enumerate().map(|(i, v)| v * w[i % w.len()]).collect();
        let saved = conveyor_engine::Saved { tensors: vec![x[0].share()] };
        Ok((conveyor_engine::Tensor::from_vec(y, x[0].shape().clone(), x[0].device())?, saved))
    }
    fn backward_input(
        &self,
        _: &conveyor_engine::Saved,
        g: &conveyor_engine::Tensor,
    ) -> conveyor_engine::Result<Vec<Option<conveyor_engine::Tensor>>> {
        let w = self.weight();
        let dx: Vec<f32> = g.as_f32()?.iter().enumerate().map(|(i, v)| v * w[i % w.len()]).collect();
        Ok(vec![Some(conveyor_engine::Tensor::from_vec(dx, g.shape().clone(), g.device())?)])
    }
    fn backward_weight(
        &self,
        saved: &conveyor_engine::Saved,
        g: &conveyor_engine::Tensor,
        grads: &mut [conveyor_engine::Tensor],
    ) -> conveyor_engine::Result<()> {
        let dw = grads[0].as_f32_mut()?;
        let n = dw.len();
        for (i, (g, x)) in g.as_f32()?.iter().zip(saved.tensors[0].as_f32()?).enumerate() {
            dw[i % n] += g * x;
        }
        Ok(())
    }
    fn cost(&self, _: &[conveyor_engine::Shape]) -> conveyor_engine::Result<conveyor_engine::LayerCost> {
        Ok(conveyor_engine::LayerCost::default())
    }
}

/// Half the summed squares of the output, over the batch's rows: pulls every output toward 0.
#[derive(Debug)]
struct HalfSquares;

impl conveyor_engine::Loss for HalfSquares {
    fn loss_and_grad(
        &self,
        y: &conveyor_engine::Tensor,
        _: &conveyor_engine::Targets,
        rows: f32,
    ) -> conveyor_engine::Result<(f64, conveyor_engine::Tensor)> {
        let values = y.as_f32()?;
        let loss = values.iter().map(|v| f64::from(v * v) / 2.0).sum::<f64>() / f64::from(rows);
        let grad = values.iter().map(|v| v / rows).collect();
        Ok((loss, conveyor_engine::Tensor::from_vec(grad, y.shape().clone(), y.device())?))
    }
}

/// The model: input `x` of 4 features, then the layers `a` and `b` (parameters `a.weight` and
/// `b.weight`, each `[4]`).
fn graph() -> conveyor_engine::graph::Graph {
    let mut g = conveyor_engine::graph::Graph::new();
    let x = g.input("x", [4]).unwrap();
    let a = g.add("a", Scale::new(vec![0.5, 1.0, 1.5, 2.0]), &[x]).unwrap();
    let b = g.add("b", Scale::new(vec![1.0, -1.0, 0.5, 2.0]), &[a]).unwrap();
    g.set_output(b).unwrap();
    g
}

/// The model's loss.
fn loss() -> std::sync::Arc<dyn conveyor_engine::Loss> {
    std::sync::Arc::new(HalfSquares)
}

/// A batch of 4 rows.
fn batch() -> conveyor_engine::Tensor {
    let values = (0..16).map(|i| i as f32 / 8.0 - 1.0).collect();
    conveyor_engine::Tensor::from_vec(values, [4, 4], &conveyor_engine::Device::host()).unwrap()
}

/// Trains `steps` optimizer steps on [`batch`].
fn train(trainer: &mut conveyor_engine::runtime::Trainer, steps: usize) -> conveyor_engine::Result<()> {
    for _ in 0..steps {
        trainer.train_step(&batch(), &[0; 4])?;
    }
    Ok(())
}

/// A path in the temporary directory, unique to this process.
fn temp_path(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("conveyor-doc-{}-{name}", std::process::id()))
}
