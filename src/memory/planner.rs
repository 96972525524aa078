//! The planner: bytes per device and traffic per step for every stage and offload choice.
