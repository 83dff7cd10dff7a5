// RUN: mm-opt %s -p 'builtin.module(mm-schedule-fragments)' --split-input-file --verify-diagnostics | filecheck %s

// A loop over two microbatches of a two-stage body (a on devices 0,1; b on 2,3):
// the schedule is recorded on the loop as (body call, microbatch) pairs in dispatch
// order; the module's mm.schedule_config names the schedule.
//
// GPipe (fill-drain): both forwards of a submesh before its backwards
// (a: F0 F1 B0 B1, b: F0 F1 B0 B1).
// CHECK-LABEL: func.func @main
// CHECK: stablehlo.custom_call @mm.microbatch_loop
// CHECK-SAME: mm.schedule = {name = "gpipe", order = array<i64: 0, 0, 0, 1, 1, 0, 1, 1, 2, 0, 3, 0, 2, 1, 3, 1>}
// The body is unchanged.
// CHECK-LABEL: func.func private @microbatch_loop
// CHECK-NEXT: call @a_fwd
// CHECK-NEXT: call @b_fwd
// CHECK-NEXT: call @b_bwd
// CHECK-NEXT: call @a_bwd
module attributes {mm.schedule_config = {schedule = "gpipe"}} {
  func.func @main(%arg0: tensor<8xf32>) -> tensor<8xf32> {
    %0 = stablehlo.custom_call @mm.microbatch_loop(%arg0, %arg0) {mm.body = @microbatch_loop, mm.num_microbatches = 2 : i64} : (tensor<8xf32>, tensor<8xf32>) -> tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @microbatch_loop(%i: tensor<i32>, %acc: tensor<8xf32>, %x: tensor<8xf32>) -> tensor<8xf32> {
    %0 = call @a_fwd(%x) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %1 = call @b_fwd(%0) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %2 = call @b_bwd(%1) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %3 = call @a_bwd(%2, %0, %acc) {mm.fragment} : (tensor<8xf32>, tensor<8xf32>, tensor<8xf32>) -> tensor<8xf32>
    return %3 : tensor<8xf32>
  }
  func.func private @a_fwd(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [0, 1], mm.task = {name = "a", transpose_count = 0 : i64, loop = 0 : i64}} {
    return %arg0 : tensor<8xf32>
  }
  func.func private @b_fwd(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [2, 3], mm.task = {name = "b", transpose_count = 0 : i64, loop = 0 : i64}} {
    return %arg0 : tensor<8xf32>
  }
  func.func private @b_bwd(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [2, 3], mm.task = {name = "b", transpose_count = 1 : i64, loop = 0 : i64}} {
    return %arg0 : tensor<8xf32>
  }
  func.func private @a_bwd(%arg0: tensor<8xf32>, %arg1: tensor<8xf32>, %arg2: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [0, 1], mm.task = {name = "a", transpose_count = 1 : i64, loop = 0 : i64}} {
    return %arg0 : tensor<8xf32>
  }
}

// -----

// unrolling=1: GPipe one microbatch at a time (F0 B0 F1 B1 on every submesh).
// CHECK-LABEL: func.func @main
// CHECK-SAME: attributes {unrolled}
// CHECK: mm.schedule = {name = "gpipe", order = array<i64: 0, 0, 1, 0, 2, 0, 3, 0, 0, 1, 1, 1, 2, 1, 3, 1>}
module attributes {mm.schedule_config = {unrolling = 1 : i64}} {
  func.func @main(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {unrolled} {
    %0 = stablehlo.custom_call @mm.microbatch_loop(%arg0, %arg0) {mm.body = @microbatch_loop, mm.num_microbatches = 2 : i64} : (tensor<8xf32>, tensor<8xf32>) -> tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @microbatch_loop(%i: tensor<i32>, %acc: tensor<8xf32>, %x: tensor<8xf32>) -> tensor<8xf32> {
    %0 = call @a_fwd(%x) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %1 = call @b_fwd(%0) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %2 = call @b_bwd(%1) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %3 = call @a_bwd(%2, %0, %acc) {mm.fragment} : (tensor<8xf32>, tensor<8xf32>, tensor<8xf32>) -> tensor<8xf32>
    return %3 : tensor<8xf32>
  }
  func.func private @a_fwd(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [0, 1], mm.task = {name = "a", transpose_count = 0 : i64, loop = 0 : i64}} {
    return %arg0 : tensor<8xf32>
  }
  func.func private @b_fwd(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [2, 3], mm.task = {name = "b", transpose_count = 0 : i64, loop = 0 : i64}} {
    return %arg0 : tensor<8xf32>
  }
  func.func private @b_bwd(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [2, 3], mm.task = {name = "b", transpose_count = 1 : i64, loop = 0 : i64}} {
    return %arg0 : tensor<8xf32>
  }
  func.func private @a_bwd(%arg0: tensor<8xf32>, %arg1: tensor<8xf32>, %arg2: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [0, 1], mm.task = {name = "a", transpose_count = 1 : i64, loop = 0 : i64}} {
    return %arg0 : tensor<8xf32>
  }
}

// -----

// 1F1B: the last submesh alternates forward and backward (b: F0 B0 F1 B1).
// CHECK-LABEL: func.func @main
// CHECK-SAME: attributes {one_f_one_b}
// CHECK: mm.schedule = {name = "1f1b", order = array<i64: 0, 0, 0, 1, 1, 0, 2, 0, 3, 0, 1, 1, 2, 1, 3, 1>}
module attributes {mm.schedule_config = {schedule = "1f1b"}} {
  func.func @main(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {one_f_one_b} {
    %0 = stablehlo.custom_call @mm.microbatch_loop(%arg0, %arg0) {mm.body = @microbatch_loop, mm.num_microbatches = 2 : i64} : (tensor<8xf32>, tensor<8xf32>) -> tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @microbatch_loop(%i: tensor<i32>, %acc: tensor<8xf32>, %x: tensor<8xf32>) -> tensor<8xf32> {
    %0 = call @a_fwd(%x) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %1 = call @b_fwd(%0) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %2 = call @b_bwd(%1) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %3 = call @a_bwd(%2, %0, %acc) {mm.fragment} : (tensor<8xf32>, tensor<8xf32>, tensor<8xf32>) -> tensor<8xf32>
    return %3 : tensor<8xf32>
  }
  func.func private @a_fwd(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [0, 1], mm.task = {name = "a", transpose_count = 0 : i64, loop = 0 : i64}} {
    return %arg0 : tensor<8xf32>
  }
  func.func private @b_fwd(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [2, 3], mm.task = {name = "b", transpose_count = 0 : i64, loop = 0 : i64}} {
    return %arg0 : tensor<8xf32>
  }
  func.func private @b_bwd(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [2, 3], mm.task = {name = "b", transpose_count = 1 : i64, loop = 0 : i64}} {
    return %arg0 : tensor<8xf32>
  }
  func.func private @a_bwd(%arg0: tensor<8xf32>, %arg1: tensor<8xf32>, %arg2: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [0, 1], mm.task = {name = "a", transpose_count = 1 : i64, loop = 0 : i64}} {
    return %arg0 : tensor<8xf32>
  }
}

// -----

// A schedule asked for a loop whose tasks all share one submesh cannot pipeline
// anything: the pass records it and says so.
// CHECK-LABEL: func.func @main
// CHECK-SAME: attributes {one_stage}
// CHECK: mm.schedule = {name = "1f1b"
module attributes {mm.schedule_config = {schedule = "1f1b"}} {
  func.func @main(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {one_stage} {
    // expected-warning@+1 {{schedule '1f1b' does not apply: the microbatch loop has a single pipeline stage}}
    %0 = stablehlo.custom_call @mm.microbatch_loop(%arg0, %arg0) {mm.body = @microbatch_loop, mm.num_microbatches = 2 : i64} : (tensor<8xf32>, tensor<8xf32>) -> tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @microbatch_loop(%i: tensor<i32>, %acc: tensor<8xf32>, %x: tensor<8xf32>) -> tensor<8xf32> {
    %0 = call @a_fwd(%x) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %1 = call @a_bwd(%0, %acc) {mm.fragment} : (tensor<8xf32>, tensor<8xf32>) -> tensor<8xf32>
    return %1 : tensor<8xf32>
  }
  func.func private @a_fwd(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [0, 1], mm.task = {name = "a", transpose_count = 0 : i64, loop = 0 : i64}} {
    return %arg0 : tensor<8xf32>
  }
  func.func private @a_bwd(%arg0: tensor<8xf32>, %arg1: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [0, 1], mm.task = {name = "a", transpose_count = 1 : i64, loop = 0 : i64}} {
    return %arg0 : tensor<8xf32>
  }
}

// -----

// interleaved-1f1b with one stage per submesh (contiguous) has nothing to interleave:
// it warns and records 1F1B's order.
// CHECK-LABEL: func.func @main
// CHECK-SAME: attributes {contiguous}
// CHECK: mm.schedule = {name = "interleaved-1f1b", order = array<i64: 0, 0, 0, 1, 1, 0, 2, 0, 3, 0, 1, 1, 2, 1, 3, 1>}
module attributes {mm.schedule_config = {schedule = "interleaved-1f1b"}} {
  func.func @main(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {contiguous} {
    // expected-warning@+1 {{schedule 'interleaved-1f1b' has nothing to interleave: each of the 2 submeshes runs one pipeline stage (contiguous stages), so it runs plain 1F1B}}
    %0 = stablehlo.custom_call @mm.microbatch_loop(%arg0, %arg0) {mm.body = @microbatch_loop, mm.num_microbatches = 2 : i64} : (tensor<8xf32>, tensor<8xf32>) -> tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @microbatch_loop(%i: tensor<i32>, %acc: tensor<8xf32>, %x: tensor<8xf32>) -> tensor<8xf32> {
    %0 = call @a_fwd(%x) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %1 = call @b_fwd(%0) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %2 = call @b_bwd(%1) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %3 = call @a_bwd(%2, %0, %acc) {mm.fragment} : (tensor<8xf32>, tensor<8xf32>, tensor<8xf32>) -> tensor<8xf32>
    return %3 : tensor<8xf32>
  }
  func.func private @a_fwd(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [0, 1], mm.task = {name = "a", transpose_count = 0 : i64, loop = 0 : i64}} {
    return %arg0 : tensor<8xf32>
  }
  func.func private @b_fwd(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [2, 3], mm.task = {name = "b", transpose_count = 0 : i64, loop = 0 : i64}} {
    return %arg0 : tensor<8xf32>
  }
  func.func private @b_bwd(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [2, 3], mm.task = {name = "b", transpose_count = 1 : i64, loop = 0 : i64}} {
    return %arg0 : tensor<8xf32>
  }
  func.func private @a_bwd(%arg0: tensor<8xf32>, %arg1: tensor<8xf32>, %arg2: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [0, 1], mm.task = {name = "a", transpose_count = 1 : i64, loop = 0 : i64}} {
    return %arg0 : tensor<8xf32>
  }
}

// -----

// zero-bubble-h1 with no backward split into activation and weight halves (no
// mm.split) has nothing to defer: it warns and records 1F1B's order.
// CHECK-LABEL: func.func @main
// CHECK-SAME: attributes {unsplit}
// CHECK: mm.schedule = {name = "zero-bubble-h1", order = array<i64: 0, 0, 0, 1, 1, 0, 2, 0, 3, 0, 1, 1, 2, 1, 3, 1>}
module attributes {mm.schedule_config = {schedule = "zero-bubble-h1"}} {
  func.func @main(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {unsplit} {
    // expected-warning@+1 {{schedule 'zero-bubble-h1' has no weight-gradient half to defer}}
    %0 = stablehlo.custom_call @mm.microbatch_loop(%arg0, %arg0) {mm.body = @microbatch_loop, mm.num_microbatches = 2 : i64} : (tensor<8xf32>, tensor<8xf32>) -> tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @microbatch_loop(%i: tensor<i32>, %acc: tensor<8xf32>, %x: tensor<8xf32>) -> tensor<8xf32> {
    %0 = call @a_fwd(%x) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %1 = call @b_fwd(%0) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %2 = call @b_bwd(%1) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %3 = call @a_bwd(%2, %0, %acc) {mm.fragment} : (tensor<8xf32>, tensor<8xf32>, tensor<8xf32>) -> tensor<8xf32>
    return %3 : tensor<8xf32>
  }
  func.func private @a_fwd(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [0, 1], mm.task = {name = "a", transpose_count = 0 : i64, loop = 0 : i64}} {
    return %arg0 : tensor<8xf32>
  }
  func.func private @b_fwd(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [2, 3], mm.task = {name = "b", transpose_count = 0 : i64, loop = 0 : i64}} {
    return %arg0 : tensor<8xf32>
  }
  func.func private @b_bwd(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [2, 3], mm.task = {name = "b", transpose_count = 1 : i64, loop = 0 : i64}} {
    return %arg0 : tensor<8xf32>
  }
  func.func private @a_bwd(%arg0: tensor<8xf32>, %arg1: tensor<8xf32>, %arg2: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [0, 1], mm.task = {name = "a", transpose_count = 1 : i64, loop = 0 : i64}} {
    return %arg0 : tensor<8xf32>
  }
}

// -----

// interleave=2 needs two stages per submesh; these submeshes run one each.
module attributes {mm.schedule_config = {schedule = "interleaved-1f1b", interleave = 2 : i64}} {
  func.func @main(%arg0: tensor<8xf32>) -> tensor<8xf32> {
    // expected-error@+1 {{interleave=2, but submesh 0 runs 1 pipeline stage(s) (stages [0])}}
    %0 = stablehlo.custom_call @mm.microbatch_loop(%arg0) {mm.body = @microbatch_loop, mm.num_microbatches = 2 : i64} : (tensor<8xf32>) -> tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @microbatch_loop(%i: tensor<i32>, %acc: tensor<8xf32>) -> tensor<8xf32> {
    %0 = call @a_fwd(%acc) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %1 = call @b_fwd(%0) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    return %1 : tensor<8xf32>
  }
  func.func private @a_fwd(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [0, 1], mm.task = {name = "a", transpose_count = 0 : i64, loop = 0 : i64}} {
    return %arg0 : tensor<8xf32>
  }
  func.func private @b_fwd(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [2, 3], mm.task = {name = "b", transpose_count = 0 : i64, loop = 0 : i64}} {
    return %arg0 : tensor<8xf32>
  }
}

// -----

// unrolling applies to GPipe only.
module attributes {mm.schedule_config = {schedule = "1f1b", unrolling = 2 : i64}} {
  func.func @main(%arg0: tensor<8xf32>) -> tensor<8xf32> {
    // expected-error@+1 {{unrolling=2 applies to the gpipe schedule only, not '1f1b'}}
    %0 = stablehlo.custom_call @mm.microbatch_loop(%arg0) {mm.body = @microbatch_loop, mm.num_microbatches = 2 : i64} : (tensor<8xf32>) -> tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @microbatch_loop(%i: tensor<i32>, %acc: tensor<8xf32>) -> tensor<8xf32> {
    %0 = call @a_fwd(%acc) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @a_fwd(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [0, 1], mm.task = {name = "a", transpose_count = 0 : i64, loop = 0 : i64}} {
    return %arg0 : tensor<8xf32>
  }
}

// -----

// The MPMD form is required.
module {
  func.func @main(%arg0: tensor<8xf32>) -> tensor<8xf32> {
    // expected-error@+1 {{mm-schedule-fragments expects a module in MPMD form, but this one is in flat form (one @main, ops tagged with their task, docs/ir.md sections 2-3); run mm-outline-fragments first}}
    %0 = stablehlo.sine %arg0 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
}
