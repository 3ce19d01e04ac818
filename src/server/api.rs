//! The client-facing operations and answers live with the node logic (`crate::node::api`); the
//! front ends import them from here.

pub use crate::node::api::*;
