#pragma once
// The checkpoint module (docs/checkpoints.md): sharded, topology-independent, atomic,
// checksummed checkpoints of named logical tensors, and their streamed safetensors export.

#include <zero/checkpoint/crc32c.hpp>
#include <zero/checkpoint/export_safetensors.hpp>
#include <zero/checkpoint/index.hpp>
#include <zero/checkpoint/layout.hpp>
#include <zero/checkpoint/publish.hpp>
#include <zero/checkpoint/reader.hpp>
#include <zero/checkpoint/save.hpp>
#include <zero/checkpoint/segment.hpp>
#include <zero/checkpoint/unit_segments.hpp>
