//! The kit's device contract on this backend: step and import rollback, canonical rows,
//! pool growth (a full pool included), attention under each mask kind.

kvplug_backend_kit::backend_tests!(kvplug_backend_template::TemplateDevice);
