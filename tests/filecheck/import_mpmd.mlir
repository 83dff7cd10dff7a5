// RUN: mm-opt %S/Inputs/import_mpmd_2stage.mlir -p 'builtin.module(mm-import-mpmd{meshes=m1=0-3;m2=4-7},mm-verify)' | filecheck %s --check-prefix=TWO
// RUN: mm-opt %S/Inputs/import_mpmd_1f1b.mlir -p 'builtin.module(mm-import-mpmd{meshes=m1=0-3;m2=4-7},mm-verify)' | filecheck %s --check-prefix=PIPE
// RUN: mm-opt %s -p 'builtin.module(mm-import-mpmd,mm-verify)' --split-input-file | filecheck %s


// The partitioner's 2-stage value_and_grad (Inputs/import_mpmd_2stage.mlir; m1 is
// x=4, m2 is x=2,y=2): one sdy.mesh per mesh from the topology, @main arguments
// placed by mm.devices/mm.sharding, the partitioner's call order kept, each
// fragment a nested module on its own mesh_shape with every sharding explicit.
// TWO:      module @jit_loss attributes {
// TWO-SAME:   mm.num_devices = 8 : i64
// TWO-SAME:   mm.tasks = {stage1 = {axis_names = ["x"], axis_sizes = [4], devices = [0, 1, 2, 3], logical_axes = []}, stage2 = {axis_names = ["x", "y"], axis_sizes = [2, 2], devices = [4, 5, 6, 7], logical_axes = []}}
// TWO-NEXT:   sdy.mesh @mesh_m1 = <["x"=4]>
// TWO-NEXT:   sdy.mesh @mesh_m2 = <["x"=2, "y"=2]>
// TWO-NOT:    sdy.mesh @mesh =
// TWO-LABEL:  func.func public @main(
// TWO-SAME{LITERAL}: %arg0: tensor<8x8xf32> {mm.devices = [0, 1, 2, 3], mm.sharding = #sdy.sharding<@mesh_m1, [{}, {}]>}
// TWO-SAME{LITERAL}: %arg1: tensor<8x8xf32> {mm.devices = [4, 5, 6, 7], mm.sharding = #sdy.sharding<@mesh_m2, [{}, {}]>}
// TWO-SAME{LITERAL}: %arg2: tensor<1x16x8xf32> {mm.devices = [0, 1, 2, 3], mm.sharding = #sdy.sharding<@mesh_m1, [{}, {"x"}, {}]>}
// TWO-SAME:   -> (tensor<f32> {jax.result_info = "result[0]"}, tensor<8x8xf32> {{.*}}, tensor<8x8xf32> {{.*}}) {
// TWO-NEXT:   %[[F1:.*]]:2 = stablehlo.custom_call @mm.fragment_call(%arg0, %arg2) {mm.fragment = @p0_stage1_fwd.loss}
// TWO-NEXT:   %[[T1:.*]] = stablehlo.custom_call @mm.transfer(%[[F1]]#0)
// TWO-SAME{LITERAL}: {mm.devices = [4, 5, 6, 7], mm.sharding = #sdy.sharding<@mesh_m2, [{}, {}]>}
// TWO-NEXT:   %[[F2:.*]]:4 = stablehlo.custom_call @mm.fragment_call(%arg1, %[[T1]]) {mm.fragment = @p1_stage2_fwd.loss}
// TWO-NEXT:   %[[B2:.*]]:2 = stablehlo.custom_call @mm.fragment_call(%arg1, %[[T1]], %[[F2]]#1, %[[F2]]#2, %[[F2]]#3) {mm.fragment = @p2_stage2_bwd.loss}
// TWO-NEXT:   %[[T2:.*]] = stablehlo.custom_call @mm.transfer(%[[B2]]#1)
// TWO-SAME{LITERAL}: {mm.devices = [0, 1, 2, 3], mm.sharding = #sdy.sharding<@mesh_m1, [{"x"}, {}]>}
// TWO-NEXT:   %[[B1:.*]] = stablehlo.custom_call @mm.fragment_call(%[[F1]]#0, %[[F1]]#1, %[[T2]], %arg2) {mm.fragment = @p3_stage1_bwd.loss}
// TWO-NEXT:   return %[[F2]]#0, %[[B1]], %[[B2]]#0 : tensor<f32>, tensor<8x8xf32>, tensor<8x8xf32>
// TWO:        module @p0_stage1_fwd.loss attributes {mhlo.num_partitions = 4 : i32, mhlo.num_replicas = 1 : i32, mm.devices = [0, 1, 2, 3], mm.task = {name = "stage1", transpose_count = 0 : i64}}
// TWO-NEXT:     sdy.mesh @mesh = <["x"=4]>
// TWO-NEXT:     func.func public @main(
// TWO-SAME{LITERAL}: -> (tensor<16x8xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"x"}, {}]>}, tensor<16x8xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"x"}, {}]>}) {
// The m2 fragments get m2's own mesh (not the module's x=4 @mesh) and explicit
// replicated shardings where the partitioner left them implicit.
// TWO:        module @p1_stage2_fwd.loss attributes {{.*}}mm.devices = [4, 5, 6, 7], mm.task = {name = "stage2", transpose_count = 0 : i64}}
// TWO-NEXT:     sdy.mesh @mesh = <["x"=2, "y"=2]>
// TWO-NEXT{LITERAL}: func.func public @main(%arg0: tensor<8x8xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, %arg1: tensor<16x8xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}) -> (tensor<f32> {sdy.sharding = #sdy.sharding<@mesh, []>}, tensor<16x8xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, tensor<16x8xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, tensor<16x8xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}) {
// TWO:        module @p2_stage2_bwd.loss attributes {{.*}}mm.task = {name = "stage2", transpose_count = 1 : i64}}
// TWO:        module @p3_stage1_bwd.loss attributes {{.*}}mm.task = {name = "stage1", transpose_count = 1 : i64}}
// TWO-NOT:    mpmd.
// TWO-NOT:    mesh_shape
// TWO-NOT:    reserved_hbm_bytes
// TWO-NOT:    jax.buffer_donor
// TWO-NOT:    tf.aliasing_output

// 2 stages x 4 microbatches, 1F1B (Inputs/import_mpmd_1f1b.mlir): the calls keep the
// partitioner's order (m1: F0 F1 F2 B1 F3 B2 B3 B0; m2: F0 F1 B1 F2 B2 F3 B3 B0),
// and a fragment shared by several microbatches is one nested module.
// PIPE-LABEL: func.func public @main(
// PIPE:       @mm.fragment_call({{.*}}mm.fragment = @p0_stage0_fwd_call0.loss}
// PIPE-NEXT:  @mm.transfer(
// PIPE-NEXT:  @mm.fragment_call({{.*}}mm.fragment = @p1_stage1_fwd_calls0to3.loss}
// PIPE-NEXT:  @mm.fragment_call({{.*}}mm.fragment = @p2_stage0_fwd_calls1to3.loss}
// PIPE-NEXT:  @mm.transfer(
// PIPE-NEXT:  @mm.fragment_call({{.*}}mm.fragment = @p1_stage1_fwd_calls0to3.loss}
// PIPE-NEXT:  @mm.fragment_call({{.*}}mm.fragment = @p2_stage0_fwd_calls1to3.loss}
// PIPE-NEXT:  @mm.transfer(
// PIPE-NEXT:  @mm.fragment_call({{.*}}mm.fragment = @p3_stage1_bwd_calls1to3.loss}
// PIPE-NEXT:  @mm.transfer(
// PIPE-NEXT:  @mm.fragment_call({{.*}}mm.fragment = @p4_stage0_bwd_calls1to3.loss}
// PIPE-NEXT:  @mm.fragment_call({{.*}}mm.fragment = @p1_stage1_fwd_calls0to3.loss}
// PIPE-NEXT:  @mm.fragment_call({{.*}}mm.fragment = @p2_stage0_fwd_calls1to3.loss}
// PIPE-NEXT:  @mm.transfer(
// PIPE-NEXT:  @mm.fragment_call({{.*}}mm.fragment = @p3_stage1_bwd_calls1to3.loss}
// PIPE-NEXT:  @mm.transfer(
// PIPE-NEXT:  @mm.fragment_call({{.*}}mm.fragment = @p4_stage0_bwd_calls1to3.loss}
// PIPE-NEXT:  @mm.fragment_call({{.*}}mm.fragment = @p1_stage1_fwd_calls0to3.loss}
// PIPE-NEXT:  @mm.fragment_call({{.*}}mm.fragment = @p3_stage1_bwd_calls1to3.loss}
// PIPE-NEXT:  @mm.transfer(
// PIPE-NEXT:  @mm.fragment_call({{.*}}mm.fragment = @p4_stage0_bwd_calls1to3.loss}
// PIPE-NEXT:  @mm.fragment_call({{.*}}mm.fragment = @p5_stage1_bwd_call0.loss}
// PIPE-NEXT:  @mm.transfer(
// PIPE-NEXT:  @mm.fragment_call({{.*}}mm.fragment = @p6_stage0_bwd_call0.loss}
// PIPE-NEXT:  return
// PIPE-COUNT-7: module @p{{[0-6]}}_stage
// PIPE-NOT:   module @

// Hand-written, the mesh map given by the module attribute mm.meshes (which
// compile_mpmd sets) instead of the option: positions given out of order, a fragment merging a forward and a backward origin
// (the highest transpose count), one without origins (its task is the mesh name),
// and one function called on two meshes (a second nested module).
// CHECK-LABEL: module attributes
// CHECK-NOT:   mm.meshes
// CHECK-SAME:  mm.num_devices = 4 : i64
// CHECK-SAME:  mm.tasks = {a = {axis_names = ["x"], axis_sizes = [2], devices = [1, 0], logical_axes = []}, m2 = {axis_names = ["x"], axis_sizes = [2], devices = [3, 2], logical_axes = []}}
// CHECK-NEXT:  sdy.mesh @mesh_m1 = <["x"=2]>
// CHECK-NEXT:  sdy.mesh @mesh_m2 = <["x"=2]>
// CHECK:       %[[A:.*]] = stablehlo.custom_call @mm.fragment_call(%arg0) {mm.fragment = @f}
// CHECK-NEXT:  %[[T:.*]] = stablehlo.custom_call @mm.transfer(%[[A]])
// CHECK-SAME{LITERAL}: {mm.devices = [3, 2], mm.sharding = #sdy.sharding<@mesh_m2, [{"x"}]>}
// CHECK-NEXT:  %[[B:.*]] = stablehlo.custom_call @mm.fragment_call(%[[T]]) {mm.fragment = @f_m2}
// CHECK-NEXT:  return %[[B]]
// CHECK:       module @f attributes {{.*}}mm.devices = [1, 0], mm.task = {name = "a", transpose_count = 1 : i64}}
// CHECK-NEXT:    sdy.mesh @mesh = <["x"=2]>
// CHECK-NEXT{LITERAL}: func.func public @main(%arg0: tensor<8xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"x"}]>}) -> (tensor<8xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"x"}]>})
// CHECK:       module @f_m2 attributes {{.*}}mm.devices = [3, 2], mm.task = {name = "m2", transpose_count = 0 : i64}}
// CHECK-NEXT:    sdy.mesh @mesh = <["x"=2]>
!m1 = !mpmd.mesh_tensor<"m1", tensor<8xf32>, sharding=<@mesh, [{"x"}]>>
!m2 = !mpmd.mesh_tensor<"m2", tensor<8xf32>, sharding=<@mesh, [{"x"}]>>
module attributes {mm.meshes = {m1 = [1, 0], m2 = [3, 2]}} {
  sdy.mesh @mesh = <["x"=2]>
  func.func public @main(%arg0: !m1) -> !m2 attributes {topology = #mpmd.topology<<"m1" : <["x"=2]>>, <"m2" : <["x"=2]>>>} {
    %0 = mpmd.fragment_call<mesh="m1", origin=["a", "a"(1)]> @f(%arg0) : (!m1) -> !m1
    %1 = mpmd.transfer %0 : (!m1) -> !m2
    %2 = mpmd.fragment_call<mesh="m2", origin=[]> @f(%1) : (!m2) -> !m2
    return %2 : !m2
  }
  func.func @f(%arg0: tensor<8xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"x"}]>}) -> (tensor<8xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"x"}]>}) attributes {mesh_shape = #sdy.mesh<["x"=2]>} {
    %0 = stablehlo.sine %arg0 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
}

// -----

// A fragment that also names jax's @empty_mesh keeps it (as is) next to its own mesh.
// CHECK-LABEL: module attributes
// CHECK:       module @g attributes
// CHECK-NEXT:    sdy.mesh @mesh = <["x"=2]>
// CHECK-NEXT:    sdy.mesh @empty_mesh = <[]>
// CHECK-NEXT:    func.func public @main
// CHECK:         sdy.sharding_constraint %arg0 <@empty_mesh, [{}]>
!r1 = !mpmd.mesh_tensor<"m1", tensor<2xui32>>
module attributes {mm.meshes = {m1 = [1, 0], m2 = [3, 2]}} {
  sdy.mesh @empty_mesh = <[]>
  sdy.mesh @mesh = <["x"=4]>
  func.func public @main(%arg0: !r1) -> !r1 attributes {topology = #mpmd.topology<<"m1" : <["x"=2]>>, <"m2" : <["x"=2]>>>} {
    %0 = mpmd.fragment_call<mesh="m1", origin=["k"]> @g(%arg0) : (!r1) -> !r1
    return %0 : !r1
  }
  func.func @g(%arg0: tensor<2xui32> {sdy.sharding = #sdy.sharding<@mesh, [{}]>}) -> tensor<2xui32> attributes {mesh_shape = #sdy.mesh<["x"=2]>} {
    %0 = sdy.sharding_constraint %arg0 <@empty_mesh, [{}]> : tensor<2xui32>
    return %0 : tensor<2xui32>
  }
}

