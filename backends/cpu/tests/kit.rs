//! The kit's device contract on cpu: step and import rollback, canonical rows, pool growth,
//! attention under each mask kind.

kvplug_backend_kit::backend_tests!(kvplug_cpu::CpuDevice::new());
