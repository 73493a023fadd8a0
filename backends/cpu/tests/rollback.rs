//! The step contract on cpu: a device error at any layer rolls the step back exactly.

#[test]
fn a_fault_at_any_layer_rolls_the_step_back() {
    kvplug_backend_kit::testing::check_step_rollback(kvplug_cpu::CpuDevice::new());
}
