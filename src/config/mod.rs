//! DeepSpeed JSON config in, validated settings out.
