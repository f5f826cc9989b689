# The built-in default model: a deterministic random `tiny` model made by
# `kvserve synth` after the binary builds (no real model can ship in the repo).
set(KS_DEFAULT_MODEL ${CMAKE_BINARY_DIR}/default-model.gguf)
add_custom_command(
  OUTPUT ${KS_DEFAULT_MODEL}
  COMMAND kvserve synth --preset tiny --type q8_0 -o ${KS_DEFAULT_MODEL}
  DEPENDS kvserve
  COMMENT "Synthesizing the default model ${KS_DEFAULT_MODEL}"
  VERBATIM)
add_custom_target(default_model ALL DEPENDS ${KS_DEFAULT_MODEL})
# Unit tests that need a model but not a trained one fall back to it when
# ../shared is absent (tests/support/skip.h: what they cannot run, they skip).
set_property(TEST ${KS_UNIT_TESTS} APPEND PROPERTY ENVIRONMENT "KVSERVE_DEFAULT_MODEL=${KS_DEFAULT_MODEL}")
