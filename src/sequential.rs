//! [`Sequential`]: a chain of layers in one expression, like PyTorch's `nn.Sequential`, built into
//! a [`Graph`] whose nodes are named `0`, `1`, ... so its state dict matches PyTorch's
//! (`0.weight`, `2.bias`): `torch.nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))`
//! and `Sequential::new([64]).linear(128).relu().linear(10)` load each other's weights.
//!
//! Each layer is created when the chain is built, from the shape the previous layer outputs
//! (so `linear(128)` needs no input width) and one seeded generator, in chain order, so a chain
//! built twice from one seed holds the same weights.
use conveyor_engine::graph::Graph;
use conveyor_engine::{Error, Layer, Result, Shape, init};
use conveyor_layers::{Dropout, Flatten, Gelu, GeluTanh, LayerNorm, Linear, Relu, Tanh};
use rand::rngs::StdRng;

/// Makes one layer from the per-sample shape of its input and the chain's generator.
type MakeLayer = Box<dyn FnOnce(&Shape, &mut StdRng) -> Result<Box<dyn Layer>>>;

/// A chain of layers, each fed by the one before; see the module documentation.
///
/// ```
/// use conveyor::Sequential;
///
/// let graph = Sequential::new([64]).linear(128).relu().linear(10).build(0)?;
/// assert_eq!(graph.names(), ["x", "0", "1", "2"]);
/// assert_eq!(graph.parameter_names_in_order(), ["0.weight", "0.bias", "2.weight", "2.bias"]);
/// # Ok::<(), conveyor::engine::Error>(())
/// ```
#[must_use = "a chain does nothing until it is built"]
pub struct Sequential {
    input_shape: Shape,
    layers: Vec<(Option<String>, MakeLayer)>,
}

impl std::fmt::Debug for Sequential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sequential")
            .field("input_shape", &self.input_shape)
            .field("layers", &self.layers.len())
            .finish()
    }
}

impl Sequential {
    /// An empty chain over inputs of this per-sample shape (the graph input is named `x`).
    pub fn new(input_shape: impl Into<Shape>) -> Sequential {
        Sequential { input_shape: input_shape.into(), layers: Vec::new() }
    }

    /// Appends a layer made when the chain is built, from its input's per-sample shape and the
    /// chain's generator (for layers whose size depends on what comes before).
    pub fn then_with(mut self, make: impl FnOnce(&Shape, &mut StdRng) -> Result<Box<dyn Layer>> + 'static) -> Self {
        self.layers.push((None, Box::new(make)));
        self
    }

    /// Appends an existing layer (any [`Layer`], custom ones included).
    pub fn then(self, layer: impl Layer + 'static) -> Self {
        self.then_with(move |_, _| Ok(Box::new(layer)))
    }

    /// Appends an existing layer under a node name of your choosing instead of its position.
    pub fn then_named(mut self, name: impl Into<String>, layer: impl Layer + 'static) -> Self {
        self.layers.push((Some(name.into()), Box::new(move |_, _| Ok(Box::new(layer) as Box<dyn Layer>))));
        self
    }

    /// A [`Linear`] layer with bias to `out_features`, from the input's last dimension, initialised
    /// as PyTorch does.
    pub fn linear(self, out_features: usize) -> Self {
        self.then_with(move |shape, rng| {
            let in_features = *shape.dims().last().ok_or_else(|| {
                Error::invalid("Sequential::linear", "the input is a scalar; a Linear layer needs a feature dimension")
            })?;
            Ok(Box::new(Linear::new(in_features, out_features, true, rng)?))
        })
    }

    /// A [`Relu`].
    pub fn relu(self) -> Self {
        self.then(Relu::new())
    }

    /// A [`Gelu`] (exact, PyTorch's default).
    pub fn gelu(self) -> Self {
        self.then(Gelu::new())
    }

    /// A [`GeluTanh`] (PyTorch's `nn.GELU(approximate='tanh')`).
    pub fn gelu_tanh(self) -> Self {
        self.then(GeluTanh::new())
    }

    /// A [`Tanh`].
    pub fn tanh(self) -> Self {
        self.then(Tanh::new())
    }

    /// A [`Dropout`] with drop probability `p`.
    pub fn dropout(self, p: f32) -> Self {
        self.then_with(move |_, _| Ok(Box::new(Dropout::new(p)?)))
    }

    /// A [`LayerNorm`] over the input's last dimension.
    pub fn layer_norm(self) -> Self {
        self.then_with(move |shape, _| {
            let len = *shape.dims().last().ok_or_else(|| {
                Error::invalid("Sequential::layer_norm", "the input is a scalar; LayerNorm needs a feature dimension")
            })?;
            Ok(Box::new(LayerNorm::new(len)?))
        })
    }

    /// A [`Flatten`] (every dimension after the batch into one).
    pub fn flatten(self) -> Self {
        self.then(Flatten::new())
    }

    /// Builds the graph: input `x`, then the layers named by their position (`0`, `1`, ...) or
    /// the name given to [`Sequential::then_named`], the last one the output; parameters are drawn
    /// from `init::rng(seed)` in chain order.
    pub fn build(self, seed: u64) -> Result<Graph> {
        if self.layers.is_empty() {
            return Err(Error::invalid("Sequential", "the chain has no layers; add at least one before build"));
        }
        let mut rng = init::rng(seed);
        let mut graph = Graph::new();
        let mut node = graph.input("x", self.input_shape)?;
        for (position, (name, make)) in self.layers.into_iter().enumerate() {
            let shape = graph.node(node)?.output_shape.clone();
            let layer = make(&shape, &mut rng)?;
            let name = name.unwrap_or_else(|| position.to_string());
            node = graph.add_boxed(&name, layer, &[node])?;
        }
        graph.set_output(node)?;
        Ok(graph)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chain_matches_the_graph_built_by_hand() {
        let chain = Sequential::new([6]).linear(5).relu().linear(3).build(7).unwrap();
        let mut rng = init::rng(7);
        let mut by_hand = Graph::new();
        let x = by_hand.input("x", [6]).unwrap();
        let h = by_hand.add("0", Linear::new(6, 5, true, &mut rng).unwrap(), &[x]).unwrap();
        let h = by_hand.add("1", Relu::new(), &[h]).unwrap();
        let out = by_hand.add("2", Linear::new(5, 3, true, &mut rng).unwrap(), &[h]).unwrap();
        by_hand.set_output(out).unwrap();
        assert_eq!(chain.names(), by_hand.names());
        for (a, b) in chain.node_ids().into_iter().zip(by_hand.node_ids()) {
            let (Some(a), Some(b)) = (chain.layer(a), by_hand.layer(b)) else { continue };
            for (pa, pb) in a.parameters().iter().zip(b.parameters()) {
                assert!(pa.value.bit_eq(&pb.value), "{} differs", pa.name);
            }
        }
        assert_eq!(chain.node(chain.output().unwrap()).unwrap().output_shape, Shape::from([3]));
    }

    #[test]
    fn bad_chains_are_errors() {
        assert!(Sequential::new([4]).build(0).is_err());
        let err = Sequential::new([4]).then_named("dup", Relu::new()).then_named("dup", Relu::new()).build(0);
        assert!(err.unwrap_err().to_string().contains("dup"));
        let err = Sequential::new(Vec::<usize>::new()).linear(3).build(0).unwrap_err();
        assert!(err.to_string().contains("scalar"), "{err}");
    }
}
