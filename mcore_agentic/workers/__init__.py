"""Actor, reference and critic over a shared Megatron engine."""
