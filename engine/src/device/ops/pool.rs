//! Pooling and the small elementwise ops the zoo's CNNs need, as device ops: max and average
//! pooling forward and backward, and the dropout mask product, dispatched as every op in
//! [`super`].
