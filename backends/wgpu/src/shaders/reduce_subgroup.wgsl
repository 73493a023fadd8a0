// project.wgsl's sums with subgroup operations (a device with the SUBGROUP feature): within
// a subgroup by shuffles, across subgroups through `part`. rows_main numbers the
// invocations subgroup by subgroup (subgroup id · size + invocation in it), so that the
// lanes of a row narrower than a subgroup share one, and a wider row takes whole ones.

// Each subgroup's total where a sum spans several.
var<workgroup> part: array<f32, 64>;

// The subgroup size (at least 4, as WebGPU guarantees: `part` holds GROUP / 4 totals).
var<private> sg_size: u32;

// The sum of `v` over the workgroup, returned to every invocation (all of them call it).
fn group_sum(v: f32, lid: u32) -> f32 {
    let s = subgroupAdd(v);
    if lid % sg_size == 0u { part[lid / sg_size] = s; }
    workgroupBarrier();
    var total = 0.0;
    for (var k = 0u; k < (GROUP + sg_size - 1u) / sg_size; k++) { total += part[k]; }
    workgroupBarrier();
    return total;
}

// Each row's total of `acc` over its `lanes` consecutive invocations into red at its first
// lane's `lid` (all invocations call it; the totals are visible to all on return): a
// butterfly of shuffles over the row's lanes in a subgroup, then the subgroups' totals of
// a wider row added from `part`.
fn lane_sums(acc: f32, lid: u32, lanes: u32) {
    var total = acc;
    for (var m = min(lanes, sg_size) / 2u; m > 0u; m >>= 1u) {
        total += subgroupShuffleXor(total, m);
    }
    if lid % sg_size == 0u { part[lid / sg_size] = total; }
    workgroupBarrier();
    if lanes > sg_size {
        let per = lanes / sg_size;
        let first = (lid / lanes) * per;
        total = 0.0;
        for (var k = 0u; k < per; k++) { total += part[first + k]; }
    }
    red[lid] = total;
    workgroupBarrier();
}

@compute @workgroup_size(GROUP)
fn rows_main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>,
             @builtin(subgroup_id) sg: u32, @builtin(subgroup_size) size: u32,
             @builtin(subgroup_invocation_id) sgi: u32) {
    sg_size = size;
    rows(wg, nw, sg * size + sgi);
}
