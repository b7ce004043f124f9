#pragma once
// safetensors import and export: SafetensorsReader (validated header, whole-tensor and range
// reads with optional dtype conversion) and SafetensorsWriter (streamed, atomic). The format and
// the errors are described in docs/safetensors.md.

#include <zero/io/safetensors_header.hpp>
#include <zero/io/safetensors_reader.hpp>
#include <zero/io/safetensors_writer.hpp>
