#pragma once
// safetensors import and export: SafetensorsReader (validated header, whole-tensor and range
// reads with optional dtype conversion), SafetensorsWriter (streamed, atomic), and Hugging Face's
// sharded checkpoints (SafetensorsShards, SafetensorsShardWriter: shards beside an index). The
// format and the errors are described in docs/safetensors.md.

#include <zero/io/safetensors_header.hpp>
#include <zero/io/safetensors_reader.hpp>
#include <zero/io/safetensors_shards.hpp>
#include <zero/io/safetensors_writer.hpp>
