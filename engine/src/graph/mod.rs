//! The computation graph: a petgraph DAG of named nodes (inputs and layers) joined by tensor edges,
//! with per-sample shapes inferred as nodes are added.
//!
//! Edges carry the input position they feed, so multi-input layers (residual Add) see their inputs
//! in the order given. One node's output may feed several nodes (skip connections).
use std::collections::HashMap;

use petgraph::Direction;
use petgraph::graph::{DiGraph, NodeIndex};
use petgraph::visit::EdgeRef;

use crate::{Error, Layer, LayerCost, Result, Shape};

/// A node of a [`Graph`], returned by [`Graph::input`] and [`Graph::add`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId(pub(crate) NodeIndex);

impl NodeId {
    /// The node's index in insertion order.
    pub fn index(self) -> usize {
        self.0.index()
    }
}

/// What a node computes.
#[derive(Debug)]
pub enum NodeOp {
    /// A graph input with its per-sample shape.
    Input,
    /// A layer applied to the node's inputs. `None` once the layer has been taken out to run.
    Layer(Option<Box<dyn Layer>>),
}

/// A named node with its inferred per-sample output shape.
#[derive(Debug)]
pub struct Node {
    /// Unique name; prefixes the node's parameters (`fc1.weight`).
    pub name: String,
    /// The operation.
    pub op: NodeOp,
    /// Per-sample output shape (without the batch dimension).
    pub output_shape: Shape,
}

/// A DAG of layers. Build it with [`Graph::input`] and [`Graph::add`]; mark the output with
/// [`Graph::set_output`]; [`Graph::validate`] checks it is complete.
#[derive(Debug, Default)]
pub struct Graph {
    graph: DiGraph<Node, usize>,
    by_name: HashMap<String, NodeId>,
    output: Option<NodeId>,
    /// Tied parameters: groups of `node.parameter` names that are one parameter ([`Graph::tie`]).
    ties: Vec<Vec<String>>,
}

impl Graph {
    /// An empty graph.
    pub fn new() -> Self {
        Graph::default()
    }

    fn insert(&mut self, name: &str, op: NodeOp, output_shape: Shape) -> Result<NodeId> {
        if name.is_empty() {
            return Err(Error::invalid("node name", "names must be non-empty"));
        }
        if self.by_name.contains_key(name) {
            return Err(Error::invalid(
                "node name",
                format!("`{name}` is already in the graph; give each node a unique name"),
            ));
        }
        let id = NodeId(self.graph.add_node(Node { name: name.to_string(), op, output_shape }));
        self.by_name.insert(name.to_string(), id);
        Ok(id)
    }

    /// Adds a graph input with the given per-sample shape.
    pub fn input(&mut self, name: &str, shape: impl Into<Shape>) -> Result<NodeId> {
        self.insert(name, NodeOp::Input, shape.into())
    }

    /// Adds a layer node fed by `inputs` (in order); infers its output shape (refusing inputs of
    /// the wrong shape, naming the node) and returns the node.
    ///
    /// ```
    /// use conveyor_engine::graph::Graph;
    /// use conveyor_engine::{ForwardCtx, Layer, Result, Saved, Tensor};
    ///
    /// /// Doubles its input (no parameters, shape-preserving: the defaults do the rest).
    /// #[derive(Debug)]
    /// struct Double;
    /// impl Layer for Double {
    ///     fn forward(&self, x: &[&Tensor], _: &ForwardCtx) -> Result<(Tensor, Saved)> {
    ///         let mut y = x[0].try_clone()?;
    ///         y.scale_in_place(2.0)?;
    ///         Ok((y, Saved::default()))
    ///     }
    ///     fn backward_input(&self, _: &Saved, g: &Tensor) -> Result<Vec<Option<Tensor>>> {
    ///         let mut dx = g.try_clone()?;
    ///         dx.scale_in_place(2.0)?;
    ///         Ok(vec![Some(dx)])
    ///     }
    /// }
    ///
    /// let mut g = Graph::new();
    /// let x = g.input("x", [3, 4])?;
    /// let y = g.add("double", Double, &[x])?;
    /// g.set_output(y)?;
    /// assert_eq!(g.node(y)?.output_shape.dims(), [3, 4]);
    /// assert!(g.add("double", Double, &[x]).is_err()); // names are unique
    /// # Ok::<(), conveyor_engine::Error>(())
    /// ```
    pub fn add(&mut self, name: &str, layer: impl Layer + 'static, inputs: &[NodeId]) -> Result<NodeId> {
        self.add_boxed(name, Box::new(layer), inputs)
    }

    /// [`Graph::add`] for an already boxed layer.
    pub fn add_boxed(&mut self, name: &str, layer: Box<dyn Layer>, inputs: &[NodeId]) -> Result<NodeId> {
        if inputs.len() != layer.n_inputs() {
            return Err(Error::invalid(
                format!("inputs of node `{name}`"),
                format!("{} takes {} input(s), {} given", layer.kind(), layer.n_inputs(), inputs.len()),
            ));
        }
        let mut shapes = Vec::with_capacity(inputs.len());
        for &input in inputs {
            let node = self.graph.node_weight(input.0).ok_or_else(|| {
                Error::invalid(
                    format!("inputs of node `{name}`"),
                    format!("node #{} is not in this graph", input.index()),
                )
            })?;
            shapes.push(node.output_shape.clone());
        }
        let output_shape = layer.output_shape(&shapes).map_err(|err| match err {
            Error::ShapeMismatch { expected, got, .. } => {
                Error::ShapeMismatch { op: format!("node `{name}` ({})", layer.kind()), expected, got }
            }
            other => other,
        })?;
        let id = self.insert(name, NodeOp::Layer(Some(layer)), output_shape)?;
        for (position, &input) in inputs.iter().enumerate() {
            self.graph.add_edge(input.0, id.0, position);
        }
        Ok(id)
    }

    /// Marks the node whose output the loss is computed on.
    pub fn set_output(&mut self, node: NodeId) -> Result<()> {
        self.node(node)?;
        self.output = Some(node);
        Ok(())
    }

    /// Declares parameters of several layers one parameter (`node.parameter` names, e.g.
    /// `["embed.weight", "head.weight"]`: a language model's token embedding and output projection,
    /// PyTorch's `head.weight = embed.weight`). A trainer keeps the copies equal
    /// ([`crate::runtime::TrainerBuilder::tie_parameters`], which adds to these); checked when the
    /// trainer is built.
    pub fn tie(&mut self, names: &[&str]) {
        self.ties.push(names.iter().map(|n| n.to_string()).collect());
    }

    /// The ties declared with [`Graph::tie`].
    pub fn ties(&self) -> &[Vec<String>] {
        &self.ties
    }

    /// The output node.
    pub fn output(&self) -> Result<NodeId> {
        self.output.ok_or_else(|| Error::invalid("graph output", "no output set; call Graph::set_output"))
    }

    /// The node with this id, or an error if it is not in this graph.
    pub fn node(&self, id: NodeId) -> Result<&Node> {
        self.graph
            .node_weight(id.0)
            .ok_or_else(|| Error::invalid("node", format!("node #{} is not in this graph", id.index())))
    }

    /// The node with this id, mutable.
    pub fn node_mut(&mut self, id: NodeId) -> Result<&mut Node> {
        self.graph
            .node_weight_mut(id.0)
            .ok_or_else(|| Error::invalid("node", format!("node #{} is not in this graph", id.index())))
    }

    /// Looks a node up by name.
    pub fn find(&self, name: &str) -> Result<NodeId> {
        self.by_name.get(name).copied().ok_or_else(|| {
            Error::invalid("node name", format!("no node named `{name}`; known nodes: {}", self.names().join(", ")))
        })
    }

    /// Node names in insertion order.
    pub fn names(&self) -> Vec<&str> {
        self.graph.node_weights().map(|n| n.name.as_str()).collect()
    }

    /// Number of nodes (inputs included).
    pub fn n_nodes(&self) -> usize {
        self.graph.node_count()
    }

    /// All node ids in insertion order (a topological order, since inputs must exist before use).
    pub fn node_ids(&self) -> Vec<NodeId> {
        self.graph.node_indices().map(NodeId).collect()
    }

    /// The ids of graph inputs.
    pub fn inputs(&self) -> Vec<NodeId> {
        self.node_ids().into_iter().filter(|&id| matches!(self.graph[id.0].op, NodeOp::Input)).collect()
    }

    /// The nodes feeding `id`, in input-position order.
    pub fn predecessors(&self, id: NodeId) -> Vec<NodeId> {
        let mut edges: Vec<(usize, NodeId)> =
            self.graph.edges_directed(id.0, Direction::Incoming).map(|e| (*e.weight(), NodeId(e.source()))).collect();
        edges.sort();
        edges.into_iter().map(|(_, n)| n).collect()
    }

    /// The nodes consuming `id`'s output (each once, in id order).
    pub fn successors(&self, id: NodeId) -> Vec<NodeId> {
        let mut out: Vec<NodeId> = self.graph.neighbors_directed(id.0, Direction::Outgoing).map(NodeId).collect();
        out.sort();
        out.dedup();
        out
    }

    /// A topological order (inputs first); an error naming a node on a cycle if there is one.
    pub fn topological_order(&self) -> Result<Vec<NodeId>> {
        petgraph::algo::toposort(&self.graph, None).map(|order| order.into_iter().map(NodeId).collect()).map_err(
            |cycle| {
                Error::invalid(
                    "graph",
                    format!("cycle through node `{}`; a graph must be acyclic", self.graph[cycle.node_id()].name),
                )
            },
        )
    }

    /// Checks the graph is runnable: an output is set, there are no cycles, every node contributes
    /// to the output (no dangling nodes), and every layer node has all its inputs.
    pub fn validate(&self) -> Result<()> {
        let output = self.output()?;
        self.topological_order()?;
        let mut reaches = vec![false; self.graph.node_count()];
        let mut stack = vec![output.0];
        while let Some(n) = stack.pop() {
            if !std::mem::replace(&mut reaches[n.index()], true) {
                stack.extend(self.graph.neighbors_directed(n, Direction::Incoming));
            }
        }
        for id in self.graph.node_indices() {
            let node = &self.graph[id];
            if !reaches[id.index()] {
                return Err(Error::invalid(
                    "graph",
                    format!(
                        "node `{}` is dangling: its output never reaches the output node; remove it or connect it",
                        node.name
                    ),
                ));
            }
            if let NodeOp::Layer(Some(layer)) = &node.op {
                let n_in = self.graph.edges_directed(id, Direction::Incoming).count();
                if n_in != layer.n_inputs() {
                    return Err(Error::invalid(
                        "graph",
                        format!(
                            "node `{}` has {n_in} inputs connected but {} needs {}",
                            node.name,
                            layer.kind(),
                            layer.n_inputs()
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    /// The layer of a node (None for inputs or taken layers).
    pub fn layer(&self, id: NodeId) -> Option<&dyn Layer> {
        match &self.graph.node_weight(id.0)?.op {
            NodeOp::Layer(Some(layer)) => Some(layer.as_ref()),
            _ => None,
        }
    }

    /// The layer of a node, mutable.
    pub fn layer_mut(&mut self, id: NodeId) -> Option<&mut Box<dyn Layer>> {
        match &mut self.graph.node_weight_mut(id.0)?.op {
            NodeOp::Layer(Some(layer)) => Some(layer),
            _ => None,
        }
    }

    /// Takes a node's layer out of the graph (to move it onto a stage worker).
    pub fn take_layer(&mut self, id: NodeId) -> Option<Box<dyn Layer>> {
        match &mut self.graph.node_weight_mut(id.0)?.op {
            NodeOp::Layer(layer) => layer.take(),
            NodeOp::Input => None,
        }
    }

    /// Puts a layer back into its node.
    pub fn put_layer(&mut self, id: NodeId, layer: Box<dyn Layer>) -> Result<()> {
        match &mut self.node_mut(id)?.op {
            NodeOp::Layer(slot) => {
                *slot = Some(layer);
                Ok(())
            }
            NodeOp::Input => Err(Error::invalid("put_layer", "an input node holds no layer")),
        }
    }

    /// Per-sample cost estimates of a layer node (zero for inputs).
    pub fn cost(&self, id: NodeId) -> Result<LayerCost> {
        let shapes: Vec<Shape> =
            self.predecessors(id).into_iter().map(|p| self.graph[p.0].output_shape.clone()).collect();
        match self.layer(id) {
            Some(layer) => layer.cost(&shapes),
            None => Ok(LayerCost::default()),
        }
    }

    /// Every parameter's full name (`node.param`) in node order, without shapes.
    pub fn parameter_names_in_order(&self) -> Vec<String> {
        self.parameter_names().into_iter().map(|(name, _)| name).collect()
    }

    /// Every parameter as `(node.param, shape)`, in node order — PyTorch's state-dict names when
    /// nodes are named like a module's children (`0`, `2`, ... for nn.Sequential).
    pub fn parameter_names(&self) -> Vec<(String, Shape)> {
        let mut out = Vec::new();
        for id in self.node_ids() {
            if let Some(layer) = self.layer(id) {
                for p in layer.parameters() {
                    out.push((format!("{}.{}", self.graph[id.0].name, p.name), p.value.shape().clone()));
                }
            }
        }
        out
    }
}
