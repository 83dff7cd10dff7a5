// RUN: mm-opt %s -p 'builtin.module(mm-schedule-fragments)' --split-input-file --verify-diagnostics | filecheck %s

// Two submeshes (a on devices 0,1; b on 2,3) x two microbatches, in program order
// (microbatch 0's forward and backward, then microbatch 1's). The schedule comes
// from the module's mm.schedule_config (pass options override it).
//
// GPipe (fill-drain): every forward before any backward on each submesh.
// CHECK-LABEL: module attributes {mm.schedule = {name = "gpipe", rows = {{\[\[}}0, 1, 5, 7], [2, 3, 4, 6]], submeshes = {{\[\[}}0, 1], [2, 3]], units = [{deps = [], fragment = "a_fwd", kind = "fwd", mesh = 0 : i64, microbatch = 0 : i64, stage = 0 : i64, task = "a"},
// CHECK: func.func @main
// CHECK-NEXT: %[[AF0:.*]] = call @a_fwd(%arg0)
// CHECK-NEXT: %[[AF1:.*]] = call @a_fwd_1(%arg1)
// CHECK-NEXT: %[[BF0:.*]] = call @b_fwd(%[[AF0]])
// CHECK-NEXT: %[[BF1:.*]] = call @b_fwd_1(%[[AF1]])
// CHECK-NEXT: %[[BB0:.*]] = call @b_bwd(%[[BF0]])
// CHECK-NEXT: %[[AB0:.*]] = call @a_bwd(%[[BB0]], %[[AF0]])
// CHECK-NEXT: %[[BB1:.*]] = call @b_bwd_1(%[[BF1]])
// CHECK-NEXT: %[[AB1:.*]] = call @a_bwd_1(%[[BB1]], %[[AF1]])
// CHECK-NEXT: return %[[AB0]], %[[AB1]]
module attributes {mm.schedule_config = {schedule = "gpipe"}} {
  sdy.mesh @mesh_a = <["x"=2]>
  sdy.mesh @mesh_b = <["y"=2]>
  func.func @main(%arg0: tensor<8xf32>, %arg1: tensor<8xf32>) -> (tensor<8xf32>, tensor<8xf32>) {
    %0 = call @a_fwd(%arg0) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %1 = call @b_fwd(%0) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %2 = call @b_bwd(%1) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %3 = call @a_bwd(%2, %0) {mm.fragment} : (tensor<8xf32>, tensor<8xf32>) -> tensor<8xf32>
    %4 = call @a_fwd_1(%arg1) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %5 = call @b_fwd_1(%4) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %6 = call @b_bwd_1(%5) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %7 = call @a_bwd_1(%6, %4) {mm.fragment} : (tensor<8xf32>, tensor<8xf32>) -> tensor<8xf32>
    return %3, %7 : tensor<8xf32>, tensor<8xf32>
  }
  func.func private @a_fwd(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [0, 1], mm.mesh = @mesh_a, mm.task = {name = "a", transpose_count = 0 : i64, microbatch = 0 : i64}} {
    %0 = stablehlo.sine %arg0 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @b_fwd(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [2, 3], mm.mesh = @mesh_b, mm.task = {name = "b", transpose_count = 0 : i64, microbatch = 0 : i64}} {
    %0 = stablehlo.sine %arg0 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @b_bwd(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [2, 3], mm.mesh = @mesh_b, mm.task = {name = "b", transpose_count = 1 : i64, microbatch = 0 : i64}} {
    %0 = stablehlo.cosine %arg0 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @a_bwd(%arg0: tensor<8xf32>, %arg1: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [0, 1], mm.mesh = @mesh_a, mm.task = {name = "a", transpose_count = 1 : i64, microbatch = 0 : i64}} {
    %0 = stablehlo.multiply %arg0, %arg1 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @a_fwd_1(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [0, 1], mm.mesh = @mesh_a, mm.task = {name = "a", transpose_count = 0 : i64, microbatch = 1 : i64}} {
    %0 = stablehlo.sine %arg0 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @b_fwd_1(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [2, 3], mm.mesh = @mesh_b, mm.task = {name = "b", transpose_count = 0 : i64, microbatch = 1 : i64}} {
    %0 = stablehlo.sine %arg0 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @b_bwd_1(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [2, 3], mm.mesh = @mesh_b, mm.task = {name = "b", transpose_count = 1 : i64, microbatch = 1 : i64}} {
    %0 = stablehlo.cosine %arg0 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @a_bwd_1(%arg0: tensor<8xf32>, %arg1: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [0, 1], mm.mesh = @mesh_a, mm.task = {name = "a", transpose_count = 1 : i64, microbatch = 1 : i64}} {
    %0 = stablehlo.multiply %arg0, %arg1 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
}
// -----

// 1F1B: the last submesh alternates forward and backward (F0 B0 F1 B1); the first
// warms up with P - 0 = 2 forwards. Units in mm.schedule are listed in the new
// call order; rows index them per submesh.
// CHECK-LABEL: module attributes {mm.schedule = {name = "1f1b", rows = {{\[\[}}0, 1, 4, 7], [2, 3, 5, 6]], submeshes = {{\[\[}}0, 1], [2, 3]],
// CHECK: func.func @main
// CHECK-NEXT: %[[AF0:.*]] = call @a_fwd(%arg0)
// CHECK-NEXT: %[[AF1:.*]] = call @a_fwd_1(%arg1)
// CHECK-NEXT: %[[BF0:.*]] = call @b_fwd(%[[AF0]])
// CHECK-NEXT: %[[BB0:.*]] = call @b_bwd(%[[BF0]])
// CHECK-NEXT: %[[AB0:.*]] = call @a_bwd(%[[BB0]], %[[AF0]])
// CHECK-NEXT: %[[BF1:.*]] = call @b_fwd_1(%[[AF1]])
// CHECK-NEXT: %[[BB1:.*]] = call @b_bwd_1(%[[BF1]])
// CHECK-NEXT: %[[AB1:.*]] = call @a_bwd_1(%[[BB1]], %[[AF1]])
// CHECK-NEXT: return %[[AB0]], %[[AB1]]
module attributes {mm.schedule_config = {schedule = "1f1b"}} {
  sdy.mesh @mesh_a = <["x"=2]>
  sdy.mesh @mesh_b = <["y"=2]>
  func.func @main(%arg0: tensor<8xf32>, %arg1: tensor<8xf32>) -> (tensor<8xf32>, tensor<8xf32>) {
    %0 = call @a_fwd(%arg0) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %1 = call @b_fwd(%0) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %2 = call @b_bwd(%1) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %3 = call @a_bwd(%2, %0) {mm.fragment} : (tensor<8xf32>, tensor<8xf32>) -> tensor<8xf32>
    %4 = call @a_fwd_1(%arg1) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %5 = call @b_fwd_1(%4) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %6 = call @b_bwd_1(%5) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %7 = call @a_bwd_1(%6, %4) {mm.fragment} : (tensor<8xf32>, tensor<8xf32>) -> tensor<8xf32>
    return %3, %7 : tensor<8xf32>, tensor<8xf32>
  }
  func.func private @a_fwd(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [0, 1], mm.mesh = @mesh_a, mm.task = {name = "a", transpose_count = 0 : i64, microbatch = 0 : i64}} {
    %0 = stablehlo.sine %arg0 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @b_fwd(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [2, 3], mm.mesh = @mesh_b, mm.task = {name = "b", transpose_count = 0 : i64, microbatch = 0 : i64}} {
    %0 = stablehlo.sine %arg0 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @b_bwd(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [2, 3], mm.mesh = @mesh_b, mm.task = {name = "b", transpose_count = 1 : i64, microbatch = 0 : i64}} {
    %0 = stablehlo.cosine %arg0 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @a_bwd(%arg0: tensor<8xf32>, %arg1: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [0, 1], mm.mesh = @mesh_a, mm.task = {name = "a", transpose_count = 1 : i64, microbatch = 0 : i64}} {
    %0 = stablehlo.multiply %arg0, %arg1 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @a_fwd_1(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [0, 1], mm.mesh = @mesh_a, mm.task = {name = "a", transpose_count = 0 : i64, microbatch = 1 : i64}} {
    %0 = stablehlo.sine %arg0 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @b_fwd_1(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [2, 3], mm.mesh = @mesh_b, mm.task = {name = "b", transpose_count = 0 : i64, microbatch = 1 : i64}} {
    %0 = stablehlo.sine %arg0 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @b_bwd_1(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [2, 3], mm.mesh = @mesh_b, mm.task = {name = "b", transpose_count = 1 : i64, microbatch = 1 : i64}} {
    %0 = stablehlo.cosine %arg0 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @a_bwd_1(%arg0: tensor<8xf32>, %arg1: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [0, 1], mm.mesh = @mesh_a, mm.task = {name = "a", transpose_count = 1 : i64, microbatch = 1 : i64}} {
    %0 = stablehlo.multiply %arg0, %arg1 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
}
// -----

// A custom schedule: one row per submesh (in order of first use); "a" is a's
// forward, "a_bwd" its backward; a bare name takes the next microbatch, or give
// [microbatch, name]. Submesh a runs both forwards, then the backwards in
// reverse microbatch order.
// CHECK-LABEL: module attributes {mm.schedule = {name = "custom", rows = {{\[\[}}0, 1, 6, 7], [2, 3, 4, 5]],
// CHECK: func.func @main
// CHECK-NEXT: call @a_fwd(%arg0)
// CHECK-NEXT: call @a_fwd_1(%arg1)
// CHECK-NEXT: call @b_fwd(
// CHECK-NEXT: call @b_bwd(
// CHECK-NEXT: call @b_fwd_1(
// CHECK-NEXT: call @b_bwd_1(
// CHECK-NEXT: call @a_bwd_1(
// CHECK-NEXT: call @a_bwd(
module attributes {mm.schedule_config = {schedule = "custom", custom_schedule = [["a", "a", [1, "a_bwd"], [0, "a_bwd"]], ["b", "b_bwd", "b", "b_bwd"]]}} {
  sdy.mesh @mesh_a = <["x"=2]>
  sdy.mesh @mesh_b = <["y"=2]>
  func.func @main(%arg0: tensor<8xf32>, %arg1: tensor<8xf32>) -> (tensor<8xf32>, tensor<8xf32>) {
    %0 = call @a_fwd(%arg0) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %1 = call @b_fwd(%0) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %2 = call @b_bwd(%1) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %3 = call @a_bwd(%2, %0) {mm.fragment} : (tensor<8xf32>, tensor<8xf32>) -> tensor<8xf32>
    %4 = call @a_fwd_1(%arg1) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %5 = call @b_fwd_1(%4) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %6 = call @b_bwd_1(%5) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %7 = call @a_bwd_1(%6, %4) {mm.fragment} : (tensor<8xf32>, tensor<8xf32>) -> tensor<8xf32>
    return %3, %7 : tensor<8xf32>, tensor<8xf32>
  }
  func.func private @a_fwd(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [0, 1], mm.mesh = @mesh_a, mm.task = {name = "a", transpose_count = 0 : i64, microbatch = 0 : i64}} {
    %0 = stablehlo.sine %arg0 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @b_fwd(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [2, 3], mm.mesh = @mesh_b, mm.task = {name = "b", transpose_count = 0 : i64, microbatch = 0 : i64}} {
    %0 = stablehlo.sine %arg0 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @b_bwd(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [2, 3], mm.mesh = @mesh_b, mm.task = {name = "b", transpose_count = 1 : i64, microbatch = 0 : i64}} {
    %0 = stablehlo.cosine %arg0 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @a_bwd(%arg0: tensor<8xf32>, %arg1: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [0, 1], mm.mesh = @mesh_a, mm.task = {name = "a", transpose_count = 1 : i64, microbatch = 0 : i64}} {
    %0 = stablehlo.multiply %arg0, %arg1 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @a_fwd_1(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [0, 1], mm.mesh = @mesh_a, mm.task = {name = "a", transpose_count = 0 : i64, microbatch = 1 : i64}} {
    %0 = stablehlo.sine %arg0 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @b_fwd_1(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [2, 3], mm.mesh = @mesh_b, mm.task = {name = "b", transpose_count = 0 : i64, microbatch = 1 : i64}} {
    %0 = stablehlo.sine %arg0 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @b_bwd_1(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [2, 3], mm.mesh = @mesh_b, mm.task = {name = "b", transpose_count = 1 : i64, microbatch = 1 : i64}} {
    %0 = stablehlo.cosine %arg0 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @a_bwd_1(%arg0: tensor<8xf32>, %arg1: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [0, 1], mm.mesh = @mesh_a, mm.task = {name = "a", transpose_count = 1 : i64, microbatch = 1 : i64}} {
    %0 = stablehlo.multiply %arg0, %arg1 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
}
// -----

// Without microbatch indices there is nothing to pipeline: the module is unchanged.
// CHECK-LABEL: module {
// CHECK-NOT: mm.schedule
// CHECK: func.func @main
// CHECK-NEXT: call @f(%arg0)
// CHECK-NEXT: call @g(
module {
  func.func @main(%arg0: tensor<8xf32>) -> tensor<8xf32> {
    %0 = call @f(%arg0) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %1 = call @g(%0) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    return %1 : tensor<8xf32>
  }
  func.func private @f(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [0, 1], mm.task = {name = "f", transpose_count = 0 : i64}} {
    return %arg0 : tensor<8xf32>
  }
  func.func private @g(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [2, 3], mm.task = {name = "g", transpose_count = 0 : i64}} {
    return %arg0 : tensor<8xf32>
  }
}
// -----

// Errors. An unknown schedule lists the valid ones.
// expected-error@+1 {{unknown schedule 'zero-bubble-h3'; valid schedules: 1f1b, custom, gpipe, interleaved-1f1b, zero-bubble-h1}}
module attributes {mm.schedule_config = {schedule = "zero-bubble-h3"}} {
  sdy.mesh @mesh_a = <["x"=2]>
  sdy.mesh @mesh_b = <["y"=2]>
  func.func @main(%arg0: tensor<8xf32>, %arg1: tensor<8xf32>) -> (tensor<8xf32>, tensor<8xf32>) {
    %0 = call @a_fwd(%arg0) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %1 = call @b_fwd(%0) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %2 = call @b_bwd(%1) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %3 = call @a_bwd(%2, %0) {mm.fragment} : (tensor<8xf32>, tensor<8xf32>) -> tensor<8xf32>
    %4 = call @a_fwd_1(%arg1) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %5 = call @b_fwd_1(%4) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %6 = call @b_bwd_1(%5) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %7 = call @a_bwd_1(%6, %4) {mm.fragment} : (tensor<8xf32>, tensor<8xf32>) -> tensor<8xf32>
    return %3, %7 : tensor<8xf32>, tensor<8xf32>
  }
  func.func private @a_fwd(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [0, 1], mm.mesh = @mesh_a, mm.task = {name = "a", transpose_count = 0 : i64, microbatch = 0 : i64}} {
    %0 = stablehlo.sine %arg0 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @b_fwd(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [2, 3], mm.mesh = @mesh_b, mm.task = {name = "b", transpose_count = 0 : i64, microbatch = 0 : i64}} {
    %0 = stablehlo.sine %arg0 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @b_bwd(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [2, 3], mm.mesh = @mesh_b, mm.task = {name = "b", transpose_count = 1 : i64, microbatch = 0 : i64}} {
    %0 = stablehlo.cosine %arg0 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @a_bwd(%arg0: tensor<8xf32>, %arg1: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [0, 1], mm.mesh = @mesh_a, mm.task = {name = "a", transpose_count = 1 : i64, microbatch = 0 : i64}} {
    %0 = stablehlo.multiply %arg0, %arg1 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @a_fwd_1(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [0, 1], mm.mesh = @mesh_a, mm.task = {name = "a", transpose_count = 0 : i64, microbatch = 1 : i64}} {
    %0 = stablehlo.sine %arg0 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @b_fwd_1(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [2, 3], mm.mesh = @mesh_b, mm.task = {name = "b", transpose_count = 0 : i64, microbatch = 1 : i64}} {
    %0 = stablehlo.sine %arg0 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @b_bwd_1(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [2, 3], mm.mesh = @mesh_b, mm.task = {name = "b", transpose_count = 1 : i64, microbatch = 1 : i64}} {
    %0 = stablehlo.cosine %arg0 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @a_bwd_1(%arg0: tensor<8xf32>, %arg1: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [0, 1], mm.mesh = @mesh_a, mm.task = {name = "a", transpose_count = 1 : i64, microbatch = 1 : i64}} {
    %0 = stablehlo.multiply %arg0, %arg1 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
}
// -----

// A custom row must run every task of its submesh once per microbatch.
// expected-error@+1 {{task 'a' has 1 microbatches in custom_schedule row 0, but there are 2 microbatches}}
module attributes {mm.schedule_config = {schedule = "custom", custom_schedule = [["a", "a_bwd", "a_bwd"], ["b", "b_bwd", "b", "b_bwd"]]}} {
  sdy.mesh @mesh_a = <["x"=2]>
  sdy.mesh @mesh_b = <["y"=2]>
  func.func @main(%arg0: tensor<8xf32>, %arg1: tensor<8xf32>) -> (tensor<8xf32>, tensor<8xf32>) {
    %0 = call @a_fwd(%arg0) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %1 = call @b_fwd(%0) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %2 = call @b_bwd(%1) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %3 = call @a_bwd(%2, %0) {mm.fragment} : (tensor<8xf32>, tensor<8xf32>) -> tensor<8xf32>
    %4 = call @a_fwd_1(%arg1) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %5 = call @b_fwd_1(%4) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %6 = call @b_bwd_1(%5) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %7 = call @a_bwd_1(%6, %4) {mm.fragment} : (tensor<8xf32>, tensor<8xf32>) -> tensor<8xf32>
    return %3, %7 : tensor<8xf32>, tensor<8xf32>
  }
  func.func private @a_fwd(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [0, 1], mm.mesh = @mesh_a, mm.task = {name = "a", transpose_count = 0 : i64, microbatch = 0 : i64}} {
    %0 = stablehlo.sine %arg0 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @b_fwd(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [2, 3], mm.mesh = @mesh_b, mm.task = {name = "b", transpose_count = 0 : i64, microbatch = 0 : i64}} {
    %0 = stablehlo.sine %arg0 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @b_bwd(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [2, 3], mm.mesh = @mesh_b, mm.task = {name = "b", transpose_count = 1 : i64, microbatch = 0 : i64}} {
    %0 = stablehlo.cosine %arg0 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @a_bwd(%arg0: tensor<8xf32>, %arg1: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [0, 1], mm.mesh = @mesh_a, mm.task = {name = "a", transpose_count = 1 : i64, microbatch = 0 : i64}} {
    %0 = stablehlo.multiply %arg0, %arg1 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @a_fwd_1(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [0, 1], mm.mesh = @mesh_a, mm.task = {name = "a", transpose_count = 0 : i64, microbatch = 1 : i64}} {
    %0 = stablehlo.sine %arg0 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @b_fwd_1(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [2, 3], mm.mesh = @mesh_b, mm.task = {name = "b", transpose_count = 0 : i64, microbatch = 1 : i64}} {
    %0 = stablehlo.sine %arg0 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @b_bwd_1(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [2, 3], mm.mesh = @mesh_b, mm.task = {name = "b", transpose_count = 1 : i64, microbatch = 1 : i64}} {
    %0 = stablehlo.cosine %arg0 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @a_bwd_1(%arg0: tensor<8xf32>, %arg1: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [0, 1], mm.mesh = @mesh_a, mm.task = {name = "a", transpose_count = 1 : i64, microbatch = 1 : i64}} {
    %0 = stablehlo.multiply %arg0, %arg1 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
}
// -----

// expected-error@+1 {{task 'b_bwd' has 1 microbatches in custom_schedule row 1, but there are 2 microbatches}}
module attributes {mm.schedule_config = {schedule = "custom", custom_schedule = [["a", "a", "a_bwd", "a_bwd"], ["b", "b", "b_bwd"]]}} {
  sdy.mesh @mesh_a = <["x"=2]>
  sdy.mesh @mesh_b = <["y"=2]>
  func.func @main(%arg0: tensor<8xf32>, %arg1: tensor<8xf32>) -> (tensor<8xf32>, tensor<8xf32>) {
    %0 = call @a_fwd(%arg0) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %1 = call @b_fwd(%0) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %2 = call @b_bwd(%1) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %3 = call @a_bwd(%2, %0) {mm.fragment} : (tensor<8xf32>, tensor<8xf32>) -> tensor<8xf32>
    %4 = call @a_fwd_1(%arg1) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %5 = call @b_fwd_1(%4) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %6 = call @b_bwd_1(%5) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %7 = call @a_bwd_1(%6, %4) {mm.fragment} : (tensor<8xf32>, tensor<8xf32>) -> tensor<8xf32>
    return %3, %7 : tensor<8xf32>, tensor<8xf32>
  }
  func.func private @a_fwd(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [0, 1], mm.mesh = @mesh_a, mm.task = {name = "a", transpose_count = 0 : i64, microbatch = 0 : i64}} {
    %0 = stablehlo.sine %arg0 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @b_fwd(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [2, 3], mm.mesh = @mesh_b, mm.task = {name = "b", transpose_count = 0 : i64, microbatch = 0 : i64}} {
    %0 = stablehlo.sine %arg0 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @b_bwd(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [2, 3], mm.mesh = @mesh_b, mm.task = {name = "b", transpose_count = 1 : i64, microbatch = 0 : i64}} {
    %0 = stablehlo.cosine %arg0 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @a_bwd(%arg0: tensor<8xf32>, %arg1: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [0, 1], mm.mesh = @mesh_a, mm.task = {name = "a", transpose_count = 1 : i64, microbatch = 0 : i64}} {
    %0 = stablehlo.multiply %arg0, %arg1 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @a_fwd_1(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [0, 1], mm.mesh = @mesh_a, mm.task = {name = "a", transpose_count = 0 : i64, microbatch = 1 : i64}} {
    %0 = stablehlo.sine %arg0 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @b_fwd_1(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [2, 3], mm.mesh = @mesh_b, mm.task = {name = "b", transpose_count = 0 : i64, microbatch = 1 : i64}} {
    %0 = stablehlo.sine %arg0 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @b_bwd_1(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [2, 3], mm.mesh = @mesh_b, mm.task = {name = "b", transpose_count = 1 : i64, microbatch = 1 : i64}} {
    %0 = stablehlo.cosine %arg0 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @a_bwd_1(%arg0: tensor<8xf32>, %arg1: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [0, 1], mm.mesh = @mesh_a, mm.task = {name = "a", transpose_count = 1 : i64, microbatch = 1 : i64}} {
    %0 = stablehlo.multiply %arg0, %arg1 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
}
// -----

// A name that is not a task of that submesh.
// expected-error@+1 {{custom_schedule row 1 names 'c', which is not a task of submesh 1 (its tasks: b, b_bwd)}}
module attributes {mm.schedule_config = {schedule = "custom", custom_schedule = [["a", "a", "a_bwd", "a_bwd"], ["b", "b", "c", "c"]]}} {
  sdy.mesh @mesh_a = <["x"=2]>
  sdy.mesh @mesh_b = <["y"=2]>
  func.func @main(%arg0: tensor<8xf32>, %arg1: tensor<8xf32>) -> (tensor<8xf32>, tensor<8xf32>) {
    %0 = call @a_fwd(%arg0) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %1 = call @b_fwd(%0) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %2 = call @b_bwd(%1) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %3 = call @a_bwd(%2, %0) {mm.fragment} : (tensor<8xf32>, tensor<8xf32>) -> tensor<8xf32>
    %4 = call @a_fwd_1(%arg1) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %5 = call @b_fwd_1(%4) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %6 = call @b_bwd_1(%5) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %7 = call @a_bwd_1(%6, %4) {mm.fragment} : (tensor<8xf32>, tensor<8xf32>) -> tensor<8xf32>
    return %3, %7 : tensor<8xf32>, tensor<8xf32>
  }
  func.func private @a_fwd(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [0, 1], mm.mesh = @mesh_a, mm.task = {name = "a", transpose_count = 0 : i64, microbatch = 0 : i64}} {
    %0 = stablehlo.sine %arg0 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @b_fwd(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [2, 3], mm.mesh = @mesh_b, mm.task = {name = "b", transpose_count = 0 : i64, microbatch = 0 : i64}} {
    %0 = stablehlo.sine %arg0 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @b_bwd(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [2, 3], mm.mesh = @mesh_b, mm.task = {name = "b", transpose_count = 1 : i64, microbatch = 0 : i64}} {
    %0 = stablehlo.cosine %arg0 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @a_bwd(%arg0: tensor<8xf32>, %arg1: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [0, 1], mm.mesh = @mesh_a, mm.task = {name = "a", transpose_count = 1 : i64, microbatch = 0 : i64}} {
    %0 = stablehlo.multiply %arg0, %arg1 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @a_fwd_1(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [0, 1], mm.mesh = @mesh_a, mm.task = {name = "a", transpose_count = 0 : i64, microbatch = 1 : i64}} {
    %0 = stablehlo.sine %arg0 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @b_fwd_1(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [2, 3], mm.mesh = @mesh_b, mm.task = {name = "b", transpose_count = 0 : i64, microbatch = 1 : i64}} {
    %0 = stablehlo.sine %arg0 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @b_bwd_1(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [2, 3], mm.mesh = @mesh_b, mm.task = {name = "b", transpose_count = 1 : i64, microbatch = 1 : i64}} {
    %0 = stablehlo.cosine %arg0 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @a_bwd_1(%arg0: tensor<8xf32>, %arg1: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [0, 1], mm.mesh = @mesh_a, mm.task = {name = "a", transpose_count = 1 : i64, microbatch = 1 : i64}} {
    %0 = stablehlo.multiply %arg0, %arg1 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
}
// -----

// One row per submesh.
// expected-error@+1 {{custom_schedule has 1 rows, but the program has 2 submeshes}}
module attributes {mm.schedule_config = {schedule = "custom", custom_schedule = [["a", "a", "a_bwd", "a_bwd"]]}} {
  sdy.mesh @mesh_a = <["x"=2]>
  sdy.mesh @mesh_b = <["y"=2]>
  func.func @main(%arg0: tensor<8xf32>, %arg1: tensor<8xf32>) -> (tensor<8xf32>, tensor<8xf32>) {
    %0 = call @a_fwd(%arg0) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %1 = call @b_fwd(%0) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %2 = call @b_bwd(%1) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %3 = call @a_bwd(%2, %0) {mm.fragment} : (tensor<8xf32>, tensor<8xf32>) -> tensor<8xf32>
    %4 = call @a_fwd_1(%arg1) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %5 = call @b_fwd_1(%4) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %6 = call @b_bwd_1(%5) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %7 = call @a_bwd_1(%6, %4) {mm.fragment} : (tensor<8xf32>, tensor<8xf32>) -> tensor<8xf32>
    return %3, %7 : tensor<8xf32>, tensor<8xf32>
  }
  func.func private @a_fwd(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [0, 1], mm.mesh = @mesh_a, mm.task = {name = "a", transpose_count = 0 : i64, microbatch = 0 : i64}} {
    %0 = stablehlo.sine %arg0 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @b_fwd(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [2, 3], mm.mesh = @mesh_b, mm.task = {name = "b", transpose_count = 0 : i64, microbatch = 0 : i64}} {
    %0 = stablehlo.sine %arg0 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @b_bwd(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [2, 3], mm.mesh = @mesh_b, mm.task = {name = "b", transpose_count = 1 : i64, microbatch = 0 : i64}} {
    %0 = stablehlo.cosine %arg0 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @a_bwd(%arg0: tensor<8xf32>, %arg1: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [0, 1], mm.mesh = @mesh_a, mm.task = {name = "a", transpose_count = 1 : i64, microbatch = 0 : i64}} {
    %0 = stablehlo.multiply %arg0, %arg1 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @a_fwd_1(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [0, 1], mm.mesh = @mesh_a, mm.task = {name = "a", transpose_count = 0 : i64, microbatch = 1 : i64}} {
    %0 = stablehlo.sine %arg0 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @b_fwd_1(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [2, 3], mm.mesh = @mesh_b, mm.task = {name = "b", transpose_count = 0 : i64, microbatch = 1 : i64}} {
    %0 = stablehlo.sine %arg0 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @b_bwd_1(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [2, 3], mm.mesh = @mesh_b, mm.task = {name = "b", transpose_count = 1 : i64, microbatch = 1 : i64}} {
    %0 = stablehlo.cosine %arg0 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @a_bwd_1(%arg0: tensor<8xf32>, %arg1: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [0, 1], mm.mesh = @mesh_a, mm.task = {name = "a", transpose_count = 1 : i64, microbatch = 1 : i64}} {
    %0 = stablehlo.multiply %arg0, %arg1 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
}
// -----

// A custom order that contradicts the data flow.
// expected-error@+1 {{custom schedule deadlocks: row 0 runs 'a_bwd' microbatch 0 before its input 'b_bwd' microbatch 0 (row 1) can be computed}}
module attributes {mm.schedule_config = {schedule = "custom", custom_schedule = [["a", "a_bwd", "a", "a_bwd"], [[1, "b"], [1, "b_bwd"], [0, "b"], [0, "b_bwd"]]]}} {
  sdy.mesh @mesh_a = <["x"=2]>
  sdy.mesh @mesh_b = <["y"=2]>
  func.func @main(%arg0: tensor<8xf32>, %arg1: tensor<8xf32>) -> (tensor<8xf32>, tensor<8xf32>) {
    %0 = call @a_fwd(%arg0) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %1 = call @b_fwd(%0) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %2 = call @b_bwd(%1) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %3 = call @a_bwd(%2, %0) {mm.fragment} : (tensor<8xf32>, tensor<8xf32>) -> tensor<8xf32>
    %4 = call @a_fwd_1(%arg1) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %5 = call @b_fwd_1(%4) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %6 = call @b_bwd_1(%5) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %7 = call @a_bwd_1(%6, %4) {mm.fragment} : (tensor<8xf32>, tensor<8xf32>) -> tensor<8xf32>
    return %3, %7 : tensor<8xf32>, tensor<8xf32>
  }
  func.func private @a_fwd(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [0, 1], mm.mesh = @mesh_a, mm.task = {name = "a", transpose_count = 0 : i64, microbatch = 0 : i64}} {
    %0 = stablehlo.sine %arg0 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @b_fwd(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [2, 3], mm.mesh = @mesh_b, mm.task = {name = "b", transpose_count = 0 : i64, microbatch = 0 : i64}} {
    %0 = stablehlo.sine %arg0 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @b_bwd(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [2, 3], mm.mesh = @mesh_b, mm.task = {name = "b", transpose_count = 1 : i64, microbatch = 0 : i64}} {
    %0 = stablehlo.cosine %arg0 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @a_bwd(%arg0: tensor<8xf32>, %arg1: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [0, 1], mm.mesh = @mesh_a, mm.task = {name = "a", transpose_count = 1 : i64, microbatch = 0 : i64}} {
    %0 = stablehlo.multiply %arg0, %arg1 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @a_fwd_1(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [0, 1], mm.mesh = @mesh_a, mm.task = {name = "a", transpose_count = 0 : i64, microbatch = 1 : i64}} {
    %0 = stablehlo.sine %arg0 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @b_fwd_1(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [2, 3], mm.mesh = @mesh_b, mm.task = {name = "b", transpose_count = 0 : i64, microbatch = 1 : i64}} {
    %0 = stablehlo.sine %arg0 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @b_bwd_1(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [2, 3], mm.mesh = @mesh_b, mm.task = {name = "b", transpose_count = 1 : i64, microbatch = 1 : i64}} {
    %0 = stablehlo.cosine %arg0 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @a_bwd_1(%arg0: tensor<8xf32>, %arg1: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [0, 1], mm.mesh = @mesh_a, mm.task = {name = "a", transpose_count = 1 : i64, microbatch = 1 : i64}} {
    %0 = stablehlo.multiply %arg0, %arg1 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
}
// -----

// A custom_schedule with another schedule (the option wins over the config).
// expected-error@+1 {{When custom_schedule is provided, schedule must be 'custom' or None, but got '1f1b'}}
module attributes {mm.schedule_config = {schedule = "1f1b", custom_schedule = [["a", "a", "a_bwd", "a_bwd"], ["b", "b", "b_bwd", "b_bwd"]]}} {
  sdy.mesh @mesh_a = <["x"=2]>
  sdy.mesh @mesh_b = <["y"=2]>
  func.func @main(%arg0: tensor<8xf32>, %arg1: tensor<8xf32>) -> (tensor<8xf32>, tensor<8xf32>) {
    %0 = call @a_fwd(%arg0) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %1 = call @b_fwd(%0) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %2 = call @b_bwd(%1) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %3 = call @a_bwd(%2, %0) {mm.fragment} : (tensor<8xf32>, tensor<8xf32>) -> tensor<8xf32>
    %4 = call @a_fwd_1(%arg1) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %5 = call @b_fwd_1(%4) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %6 = call @b_bwd_1(%5) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    %7 = call @a_bwd_1(%6, %4) {mm.fragment} : (tensor<8xf32>, tensor<8xf32>) -> tensor<8xf32>
    return %3, %7 : tensor<8xf32>, tensor<8xf32>
  }
  func.func private @a_fwd(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [0, 1], mm.mesh = @mesh_a, mm.task = {name = "a", transpose_count = 0 : i64, microbatch = 0 : i64}} {
    %0 = stablehlo.sine %arg0 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @b_fwd(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [2, 3], mm.mesh = @mesh_b, mm.task = {name = "b", transpose_count = 0 : i64, microbatch = 0 : i64}} {
    %0 = stablehlo.sine %arg0 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @b_bwd(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [2, 3], mm.mesh = @mesh_b, mm.task = {name = "b", transpose_count = 1 : i64, microbatch = 0 : i64}} {
    %0 = stablehlo.cosine %arg0 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @a_bwd(%arg0: tensor<8xf32>, %arg1: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [0, 1], mm.mesh = @mesh_a, mm.task = {name = "a", transpose_count = 1 : i64, microbatch = 0 : i64}} {
    %0 = stablehlo.multiply %arg0, %arg1 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @a_fwd_1(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [0, 1], mm.mesh = @mesh_a, mm.task = {name = "a", transpose_count = 0 : i64, microbatch = 1 : i64}} {
    %0 = stablehlo.sine %arg0 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @b_fwd_1(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [2, 3], mm.mesh = @mesh_b, mm.task = {name = "b", transpose_count = 0 : i64, microbatch = 1 : i64}} {
    %0 = stablehlo.sine %arg0 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @b_bwd_1(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [2, 3], mm.mesh = @mesh_b, mm.task = {name = "b", transpose_count = 1 : i64, microbatch = 1 : i64}} {
    %0 = stablehlo.cosine %arg0 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @a_bwd_1(%arg0: tensor<8xf32>, %arg1: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [0, 1], mm.mesh = @mesh_a, mm.task = {name = "a", transpose_count = 1 : i64, microbatch = 1 : i64}} {
    %0 = stablehlo.multiply %arg0, %arg1 : tensor<8xf32>
    return %0 : tensor<8xf32>
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
