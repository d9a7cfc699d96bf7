// What the page's modules use of the vendored uPlot 1.6.32 (static/vendor/uplot, loaded by a
// classic <script> as the global `uPlot`): a subset of its own uPlot.d.ts, for tsc only.

/** A uPlot table: the x values, then one column per series (undefined: no point, null: a hole). */
type UPlotData = Array<Array<number | null | undefined>>;

interface UPlotScale {
  min?: number;
  max?: number;
  distr?: number;
}

interface UPlotRect {
  left: number;
  top: number;
  width: number;
  height: number;
}

interface UPlotInstance {
  readonly data: UPlotData;
  readonly ctx: CanvasRenderingContext2D;
  readonly bbox: UPlotRect;
  readonly select: UPlotRect;
  readonly over: HTMLElement;
  readonly width: number;
  readonly scales: Record<string, UPlotScale>;
  readonly cursor: { idx?: number | null; left?: number; top?: number; event?: Event | null };
  setData(data: UPlotData, resetScales?: boolean): void;
  setSize(size: { width: number; height: number }): void;
  setScale(key: string, limits: { min: number; max: number }): void;
  setSelect(rect: UPlotRect, fireHook?: boolean): void;
  posToVal(position: number, scaleKey: string): number;
  valToPos(value: number, scaleKey: string, canvasPixels?: boolean): number;
  destroy(): void;
}

interface UPlotConstructor {
  new (options: object, data: UPlotData, target: HTMLElement): UPlotInstance;
  /** Tables with their own x joined on the union of their x (missing values undefined). */
  join(tables: UPlotData[]): UPlotData;
}

interface Window {
  uPlot: UPlotConstructor;
}
