//! Byte accounting per kind: parameters, gradients, master weights, optimizer states, buffers.
