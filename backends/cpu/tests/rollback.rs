//! The step and import contracts on cpu: a device error at any layer rolls the step back
//! exactly, and one during an import leaves the cache as it was.

#[test]
fn a_fault_at_any_layer_rolls_the_step_back() {
    kvplug_backend_kit::testing::check_step_rollback(kvplug_cpu::CpuDevice::new());
}

#[test]
fn a_fault_during_an_import_changes_nothing() {
    kvplug_backend_kit::testing::check_import_rollback(kvplug_cpu::CpuDevice::new());
}
