//! The kit's device contract on this backend: step and import rollback, canonical rows,
//! pool growth (a full pool included), attention under each mask kind; and its model-device
//! contract (the argmax of logit rows, here the kit's default).

kvplug_backend_kit::backend_tests!(kvplug_backend_template::TemplateDevice);
kvplug_backend_kit::model_device_tests!(kvplug_backend_template::TemplateDevice);
