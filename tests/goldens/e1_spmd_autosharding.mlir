module @jit_model attributes {mhlo.num_partitions = 1 : i32, mhlo.num_replicas = 1 : i32, mm.num_devices = 8 : i64, mm.tasks = {model = {axis_names = ["x"], axis_sizes = [8], devices = [0, 1, 2, 3, 4, 5, 6, 7], logical_axes = [["batch", "x"], ["model", "x"]]}}} {
  sdy.mesh @mesh_model = <["x"=8]>
  func.func public @main(%arg0: tensor<8x8xi32> {mm.devices = [0, 1, 2, 3, 4, 5, 6, 7], mm.sharding = #sdy.sharding<@mesh_model, [{"x"}, {}]>}, %arg1: tensor<8x8xi32> {mm.devices = [0, 1, 2, 3, 4, 5, 6, 7], mm.sharding = #sdy.sharding<@mesh_model, [{}, {"x"}]>}, %arg2: tensor<8x8xi32> {mm.devices = [0, 1, 2, 3, 4, 5, 6, 7], mm.sharding = #sdy.sharding<@mesh_model, [{"x"}, {}]>}) -> (tensor<8x8xi32> {jax.result_info = "result"}) {
    %0 = stablehlo.custom_call @mm.fragment_call(%arg2, %arg0, %arg1) {mm.fragment = @model_fwd} : (tensor<8x8xi32>, tensor<8x8xi32>, tensor<8x8xi32>) -> tensor<8x8xi32>
    return %0 : tensor<8x8xi32>
  }
  module @model_fwd attributes {mhlo.num_partitions = 8 : i32, mhlo.num_replicas = 1 : i32, mm.devices = [0, 1, 2, 3, 4, 5, 6, 7], mm.task = {name = "model", transpose_count = 0 : i64}} {
    sdy.mesh @mesh_model = <["x"=8]>
    func.func public @main(%arg0: tensor<8x8xi32> {sdy.sharding = #sdy.sharding<@mesh_model, [{"x"}, {}]>}, %arg1: tensor<8x8xi32> {sdy.sharding = #sdy.sharding<@mesh_model, [{"x"}, {}]>}, %arg2: tensor<8x8xi32> {sdy.sharding = #sdy.sharding<@mesh_model, [{}, {"x"}]>}) -> (tensor<8x8xi32> {sdy.sharding = #sdy.sharding<@mesh_model, [{"x"}, {}]>}) {
      %0 = sdy.sharding_constraint %arg0 <@mesh_model, [{"x"}, {}]> : tensor<8x8xi32>
      %1 = sdy.sharding_constraint %arg1 <@mesh_model, [{"x"}, {}]> : tensor<8x8xi32>
      %2 = sdy.sharding_constraint %arg2 <@mesh_model, [{}, {"x"}]> : tensor<8x8xi32>
      %3 = stablehlo.dot_general %0, %1, contracting_dims = [1] x [0], precision = [DEFAULT, DEFAULT] : (tensor<8x8xi32>, tensor<8x8xi32>) -> tensor<8x8xi32>
      %4 = stablehlo.dot_general %3, %2, contracting_dims = [1] x [0], precision = [DEFAULT, DEFAULT] : (tensor<8x8xi32>, tensor<8x8xi32>) -> tensor<8x8xi32>
      %5 = sdy.sharding_constraint %4 <@mesh_model, [{"x"}, {}]> : tensor<8x8xi32>
      return %5 : tensor<8x8xi32>
    }
  }
}
