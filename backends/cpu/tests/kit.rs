//! The kit's device contract on cpu: step and import rollback, canonical rows, pool growth,
//! attention under each mask kind; and its model-device contract (the argmax).

kvplug_backend_kit::backend_tests!(kvplug_cpu::CpuDevice::new());
kvplug_backend_kit::model_device_tests!(kvplug_cpu::CpuDevice::new());
