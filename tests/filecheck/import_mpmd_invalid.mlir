// RUN: mm-opt %s -p 'builtin.module(mm-import-mpmd{meshes=m1=0-3;m2=4-5;m3=6})' --split-input-file --verify-diagnostics

// Every chunk declares meshes m1 (x=4), m2 (x=2) and m3 (x=1) unless it tests the map.

// Cross-mesh reduce/broadcast are import-phase ops: the partitioner lowers them.
func.func public @main(%arg0: tensor<8xf32>, %arg1: tensor<8xf32>) -> tensor<8xf32> {
  // expected-error@+1 {{'mpmd.reduce' in @main: a cross-mesh reduce cannot run as an op (multimesh's runtime has no cross-mesh collectives); Shardy's partitioner lowers it into transfers and fragments, so partition with phases=ALL first}}
  %0 = mpmd.reduce<add> %arg0, %arg1 : (tensor<8xf32>, tensor<8xf32>) -> tensor<8xf32>
  return %0 : tensor<8xf32>
}

// -----

func.func public @main(%arg0: tensor<8xf32>) -> tensor<8xf32> {
  // expected-error@+1 {{'mpmd.broadcast' in @main: a cross-mesh broadcast cannot run as an op}}
  %0 = mpmd.broadcast %arg0 : tensor<8xf32>
  return %0 : tensor<8xf32>
}

// -----

func.func public @main(%arg0: tensor<8xf32>) -> tensor<8xf32> {
  // expected-error@+1 {{'mpmd.named_computation' in @main: the module is not partitioned yet; run Shardy's apply_mpmd_partitioning with phases=ALL first}}
  %0 = mpmd.named_computation<"a"> (%arg0) (%a: tensor<8xf32>) {
    mpmd.return %a : tensor<8xf32>
  } : (tensor<8xf32>) -> tensor<8xf32>
  return %0 : tensor<8xf32>
}

// -----

!m1 = !mpmd.mesh_tensor<"m1", tensor<8xf32>>
func.func public @main(%arg0: !m1) -> !m1 attributes {topology = #mpmd.topology<<"m1" : <["x"=4]>>, <"m2" : <["x"=2]>>, <"m3" : <["x"=1]>>>} {
  // expected-error@+1 {{'func.call' in @main cannot run: multimesh runs only 'mpmd.fragment_call', 'mpmd.transfer' and 'return' there}}
  %0 = func.call @f(%arg0) : (!m1) -> !m1
  return %0 : !m1
}
func.func private @f(%arg0: !m1) -> !m1 {
  return %arg0 : !m1
}

// -----

// A host memory kind, on an @main argument's type.
!host = !mpmd.mesh_tensor<"m1", tensor<8xf32>, memory_kind="pinned_host">
// expected-error@+1 {{@main argument #0 has memory kind "pinned_host"; multimesh runs values in device memory only (no host offloading)}}
func.func public @main(%arg0: !host) -> !host attributes {topology = #mpmd.topology<<"m1" : <["x"=4]>>, <"m2" : <["x"=2]>>, <"m3" : <["x"=1]>>>} {
  return %arg0 : !host
}

// -----

// ... and on a fragment's result.
!m1 = !mpmd.mesh_tensor<"m1", tensor<8xf32>>
func.func public @main(%arg0: !m1) -> !m1 attributes {topology = #mpmd.topology<<"m1" : <["x"=4]>>, <"m2" : <["x"=2]>>, <"m3" : <["x"=1]>>>} {
  %0 = mpmd.fragment_call<mesh="m1", origin=["a"]> @f(%arg0) : (!m1) -> !m1
  return %0 : !m1
}
// expected-error@+1 {{fragment '@f' result #0 has memory kind "pinned_host"}}
func.func @f(%arg0: tensor<8xf32>) -> (tensor<8xf32> {mhlo.memory_kind = "pinned_host"}) attributes {mesh_shape = #sdy.mesh<["x"=4]>} {
  return %arg0 : tensor<8xf32>
}

// -----

// A partial sum (unreduced axes) moved between meshes.
!m1 = !mpmd.mesh_tensor<"m1", tensor<8xf32>, sharding=<@mesh, [{}], unreduced={"x"}>>
!m2 = !mpmd.mesh_tensor<"m2", tensor<8xf32>>
module {
  sdy.mesh @mesh = <["x"=4]>
  // expected-error@+1 {{@main argument #0 has unreduced axes #sdy.sharding<@mesh, [{}], unreduced={"x"}>; multimesh moves only fully reduced values between fragments}}
  func.func public @main(%arg0: !m1) -> !m2 attributes {topology = #mpmd.topology<<"m1" : <["x"=4]>>, <"m2" : <["x"=2]>>, <"m3" : <["x"=1]>>>} {
    %0 = mpmd.transfer %arg0 : (!m1) -> !m2
    return %0 : !m2
  }
}

// -----

// The mesh map names a mesh the program does not have.
!m1 = !mpmd.mesh_tensor<"m1", tensor<8xf32>>
// expected-error@+1 {{option 'meshes' names mesh "m3", which the program does not have (its meshes: m1, m2)}}
func.func public @main(%arg0: !m1) -> !m1 attributes {topology = #mpmd.topology<<"m1" : <["x"=4]>>, <"m2" : <["x"=2]>>>} {
  return %arg0 : !m1
}

// -----

// ... or misses one it has.
!m1 = !mpmd.mesh_tensor<"m1", tensor<8xf32>>
// expected-error@+1 {{option 'meshes' gives no device positions for mesh "m4" (it gives m1, m2, m3)}}
func.func public @main(%arg0: !m1) -> !m1 attributes {topology = #mpmd.topology<<"m1" : <["x"=4]>>, <"m2" : <["x"=2]>>, <"m3" : <["x"=1]>>, <"m4" : <["x"=1]>>>} {
  return %arg0 : !m1
}

// -----

// ... or gives a mesh the wrong number of devices.
!m1 = !mpmd.mesh_tensor<"m1", tensor<8xf32>>
// expected-error@+1 {{mesh "m1" ["x"=2] has 2 devices but option 'meshes' gives it 4: [0, 1, 2, 3]}}
func.func public @main(%arg0: !m1) -> !m1 attributes {topology = #mpmd.topology<<"m1" : <["x"=2]>>, <"m2" : <["x"=2]>>, <"m3" : <["x"=1]>>>} {
  return %arg0 : !m1
}

// -----

// A sub-axis sharding on a value that crosses meshes.
!m1 = !mpmd.mesh_tensor<"m1", tensor<8xf32>, sharding=<@mesh, [{"x":(1)2}]>>
!m2 = !mpmd.mesh_tensor<"m2", tensor<8xf32>>
module {
  sdy.mesh @mesh = <["x"=4]>
  // expected-error@+1 {{@main argument #0 shards over sub-axis}}
  func.func public @main(%arg0: !m1) -> !m2 attributes {topology = #mpmd.topology<<"m1" : <["x"=4]>>, <"m2" : <["x"=2]>>, <"m3" : <["x"=1]>>>} {
    %0 = mpmd.transfer %arg0 : (!m1) -> !m2
    return %0 : !m2
  }
}

// -----

// The mpmd verifier does not compare shardings across a call; the runtime would
// receive a value laid out differently from what the fragment was compiled for.
!m1 = !mpmd.mesh_tensor<"m1", tensor<8xf32>, sharding=<@mesh, [{"x"}]>>
!r1 = !mpmd.mesh_tensor<"m1", tensor<8xf32>>
module {
  sdy.mesh @mesh = <["x"=4]>
  func.func public @main(%arg0: !m1) -> !r1 attributes {topology = #mpmd.topology<<"m1" : <["x"=4]>>, <"m2" : <["x"=2]>>, <"m3" : <["x"=1]>>>} {
    // expected-error@+1 {{operand #0 of the call of '@f' is laid out as #sdy.sharding<@mesh, [{"x"}]> but the fragment wants replicated}}
    %0 = mpmd.fragment_call<mesh="m1", origin=["a"]> @f(%arg0) : (!m1) -> !r1
    return %0 : !r1
  }
  func.func @f(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mesh_shape = #sdy.mesh<["x"=4]>} {
    return %arg0 : tensor<8xf32>
  }
}

// -----

!r1 = !mpmd.mesh_tensor<"m1", tensor<8xf32>>
module {
  sdy.mesh @mesh = <["x"=4]>
  func.func public @main(%arg0: !r1) -> !r1 attributes {topology = #mpmd.topology<<"m1" : <["x"=4]>>, <"m2" : <["x"=2]>>, <"m3" : <["x"=1]>>>} {
    // expected-error@+1 {{result #0 of the call of '@f' is typed !mpmd.mesh_tensor<"m1", tensor<8xf32>> but the fragment returns it on mesh "m1" as #sdy.sharding<@mesh, [{"x"}]>}}
    %0 = mpmd.fragment_call<mesh="m1", origin=["a"]> @f(%arg0) : (!r1) -> !r1
    return %0 : !r1
  }
  func.func @f(%arg0: tensor<8xf32>) -> (tensor<8xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"x"}]>}) attributes {mesh_shape = #sdy.mesh<["x"=4]>} {
    return %arg0 : tensor<8xf32>
  }
}

// -----

// Loops over mesh tensors (partitioned mpmd.for) are not flat.
!m1 = !mpmd.mesh_tensor<"m1", tensor<8xf32>>
func.func public @main(%arg0: !m1) -> !m1 attributes {topology = #mpmd.topology<<"m1" : <["x"=4]>>, <"m2" : <["x"=2]>>, <"m3" : <["x"=1]>>>} {
  // expected-error@+1 {{'mpmd.for' in @main: multimesh runs flat programs of fragment calls and transfers; unroll the loop before partitioning (e.g. one mpmd.call per microbatch)}}
  %0 = mpmd.for (%arg0) {iterations = 2 : ui32} (%a: !m1, %index: tensor<ui32>) {
    mpmd.return %a : !m1
  } : !m1
  return %0 : !m1
}

// -----

// The option and the module's mm.meshes disagree.
!m1 = !mpmd.mesh_tensor<"m1", tensor<8xf32>>
// expected-error@+1 {{option 'meshes' (m1=0,1,2,3;m2=4,5;m3=6) disagrees with the module's 'mm.meshes' (m1=4,5,6,7;m2=0,1;m3=2); give one}}
module attributes {mm.meshes = {m1 = [4, 5, 6, 7], m2 = [0, 1], m3 = [2]}} {
  func.func public @main(%arg0: !m1) -> !m1 attributes {topology = #mpmd.topology<<"m1" : <["x"=4]>>, <"m2" : <["x"=2]>>, <"m3" : <["x"=1]>>>} {
    return %arg0 : !m1
  }
}
