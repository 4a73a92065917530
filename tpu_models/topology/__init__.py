"""Compiling for a TPU topology (`tpu-models compile`): TPU slices by name
(`slices`); the engine's start-up on a slice that is not there, every array a
shape and every program compiled, none run (`abstract`, which adapt.topology
installs in that process only); what each chip would hold and the programs
compiled (`accounting`), with libtpu's costs of each (`costs`)."""
